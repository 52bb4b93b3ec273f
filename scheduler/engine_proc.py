"""ProcessCore: the EngineCore in a child process of its own (`serve run --engine-loop process`).

The child builds the engine itself (the parent never touches the device, and CUDA cannot be
forked: the start method is spawn), then runs its own loop: take every pending command, apply them
in order, step while anything is unfinished, and send each step's outputs as one message. The
server process then spends its GIL on HTTP, tokenization and streaming only.

The parent's event loop reads and writes both pipes through asyncio transports, so it never blocks
on the child (a blocking write could also deadlock the two when both pipes are full). Frames are
multiprocessing.connection's (a 4-byte big-endian length, then a pickle), so the child uses plain
Connection objects.

Parent -> child: ("add", id, (seq_ids, requests))  ("abort", id, seq_ids)  ("call", id, fn)  ("stop",)
Child -> parent: ("ready", info, snapshot) or ("error", message) once, then
    ("replies", [(id, ok, value or exception)], snapshot)  ("step", packed outputs, snapshot)
    ("fault", aborted seq_ids, snapshot): a step raised outside the model
    ("lost", message, snapshot): the executor is gone (scheduler/core.py's ExecutorLost), the
    step before failed every request; the child then exits with EXIT_LOST
    ("snapshot", snapshot): another API process's commands changed the engine (several of them)
A step's StepOutputs travel as tuples of their fields (pack_outputs/unpack_outputs): pickling
dataclasses one by one costs several times more, on both sides, after every step.

More API processes (`serve run --api-processes N`): the child is spawned with a pair of pipes for
each (spawn(api_channels=N - 1) keeps the parent's ends for them, ProcessCore.attach() drives one
from the API process it is handed to). Each sequence belongs to the channel that added it: a
step's outputs and a fault's aborted sequences go to their owners, and each step or fault message
(possibly without any, for the snapshot and the fault's count) to every channel that has said
("hello", id, None). A channel whose API process
closes it or dies loses its sequences (aborted); the first channel's loss ends the child as before.

Torch-free: the child builds the core with a `build` function it is given by reference.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import struct
import threading
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from operator import attrgetter
from typing import Any, TypeVar

from scheduler.core import EngineCore
from scheduler.loop import EngineEvents, EngineSnapshot, EngineUnavailable, add_all
from scheduler.request import SamplingParams, StepOutput, describe_exit

log = logging.getLogger("pagedserve")
T = TypeVar("T")
Build = Callable[..., tuple[EngineCore, Any]]  # (args) -> (core, what the parent should know)
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
STOP_TIMEOUT_S = 10.0  # a stopping child finishes its current step first
# How long the child keeps reading arriving commands before it steps. A burst of requests reaches
# it one by one as the server parses and forwards them (~0.4 ms each); reading them all first left
# the GPU idle for the whole burst (~25 ms for 64 requests), while the first ones could already run.
DRAIN_S = 0.002
EXIT_LOST = 3  # the child's exit status after its executor was lost (a tensor-parallel rank died)


_output_fields = attrgetter(*(f.name for f in fields(StepOutput)))
_FINISHED = [f.name for f in fields(StepOutput)].index("finished")  # in a packed output (seq_id first)


def pack_outputs(outputs: list[StepOutput]) -> list[tuple]:
    """StepOutputs as tuples of their field values, in field order, for the wire."""
    return list(map(_output_fields, outputs))


def unpack_outputs(rows: list[tuple]) -> list[StepOutput]:
    return [StepOutput(*row) for row in rows]


class EngineStartError(RuntimeError):
    """The engine process could not build the engine; the message says why."""


# -- the child ---------------------------------------------------------------------------------

def child_main(commands: Connection, results: Connection, build: Build, args: tuple, log_level: int,
               more: Seq[tuple[Connection, Connection]] = ()) -> None:
    """more: the (commands, results) pipes of further API processes (ProcessCore.attach)."""
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group. Once the engine
    # serves, the parent owns shutdown: the child must keep stepping while the parent drains; it
    # exits on "stop", or when the parent's end of the pipe closes. While the engine builds, a
    # SIGINT means the user gave up on starting it (the parent gives up too, and sends one itself
    # where it alone was interrupted): the child ends at once, by the signal's default action. It
    # holds nothing yet, and a KeyboardInterrupt raised inside the libraries' imports came out as
    # other errors with tracebacks (numpy's RecursionError), or was swallowed. The child starts
    # with SIGINT ignored (spawn()), so spawn's own imports are not interrupted either.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    log.debug("start-up: engine process running")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        if commands.poll():
            return  # the parent closed its end before a SIGINT could end us: it gave up already
        core, info = build(*args)
    except Exception as e:
        if not isinstance(e, ValueError):
            log.exception("building the engine failed")
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        try:
            results.send(("error", message if isinstance(e, (ValueError, OSError, RuntimeError))
                          else f"{type(e).__name__}: {message}"))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the parent is gone
        return
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Everything built so far (torch, Triton, the model) lives as long as the process: out of the
    # collector's sight, a full collection walks only what serving creates. Without this, the
    # occasional full collection stalled a step by ~20-40 ms (step traces, H100 machine).
    gc.collect()
    gc.freeze()
    log.debug("start-up: engine ready")
    try:
        results.send(("ready", info, EngineSnapshot.of(core)))
        _serve(core, [Channel(commands, results, attached=True), *(Channel(c, r) for c, r in more)])
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    finally:
        core.close()
        # Give the frozen objects back to the collector before the interpreter exits: it never
        # collects frozen ones, so reference cycles through an extension's objects outlive its
        # module's teardown. nanobind (Triton's bindings, imported by torch._dynamo wherever Triton
        # is installed, even on the CPU) then printed ~27 lines of "nanobind: leaked ..." at every
        # clean stop.
        gc.unfreeze()


@dataclass
class Channel:
    """One API process's pipes, as the child sees them. attached: it reads the step messages
    (the first channel from the start, the others once they say hello)."""

    commands: Connection
    results: Connection
    attached: bool = False
    closed: bool = False


class ChannelGone(Exception):
    """The first channel (the process that spawned the child) is gone: the child exits."""


class _Channels:
    """The child's channels and which one owns each sequence."""

    def __init__(self, core: EngineCore, channels: list[Channel]) -> None:
        self.core = core
        self.all = channels
        self.owner: dict[int, int] = {}  # seq id -> channel index (absent: the first channel's)

    def read(self, timeout: float | None) -> list[tuple[int, tuple]]:
        """The commands that arrive within `timeout` (None: block until one does), then whatever
        keeps arriving for DRAIN_S, as (channel index, message) in arrival order per channel."""
        pending: list[tuple[int, tuple]] = []
        ready = self._ready(timeout)
        deadline = time.perf_counter() + DRAIN_S
        while ready:
            for i in ready:
                try:
                    pending.append((i, self.all[i].commands.recv()))
                except (EOFError, OSError):
                    self.close(i)
            if time.perf_counter() >= deadline:
                break
            ready = self._ready(0)
        return pending

    def _ready(self, timeout: float | None) -> list[int]:
        chans = [(i, c) for i, c in enumerate(self.all) if not c.closed]
        if len(chans) == 1:  # one API process: no selector
            i, c = chans[0]
            return [i] if c.commands.poll(timeout) else []
        ready = wait([c.commands for _, c in chans], timeout)
        return [i for i, c in chans if c.commands in ready]

    def send(self, i: int, msg: tuple) -> None:
        c = self.all[i]
        if c.closed:
            return
        try:
            c.results.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self.close(i)

    def close(self, i: int) -> None:
        """Channel i's API process is gone or done: its sequences are aborted (the first
        channel's loss ends the child)."""
        if i == 0:
            raise ChannelGone
        c = self.all[i]
        if c.closed:
            return
        c.closed = True
        for conn in (c.commands, c.results):
            conn.close()
        orphans = [sid for sid, owner in self.owner.items() if owner == i]
        for sid in orphans:
            del self.owner[sid]
            self.core.abort(sid)
        if orphans:
            log.warning("an API process left; aborted its %d sequences", len(orphans))

    def alone(self) -> bool:
        """Whether only the first channel is open: everything is its own."""
        return all(c.closed for c in self.all[1:])

    def split(self, seq_ids: Seq[int], items: Seq[T]) -> dict[int, list[T]]:
        """items (one per seq id) by the channel that owns their sequence."""
        by: dict[int, list[T]] = {}
        get = self.owner.get
        for sid, item in zip(seq_ids, items):
            by.setdefault(get(sid, 0), []).append(item)
        return by


def _serve(core: EngineCore, channels: list[Channel]) -> None:
    chans = _Channels(core, channels)
    try:
        while True:
            if not core.has_unfinished():
                pending = chans.read(None)  # idle: block until there is work
            else:
                wait_s = core.hold_wait()  # new prompts held for their burst: sleep until more come or it ends
                pending = chans.read(wait_s if wait_s > 0 else 0)
            replies: dict[int, list] = {}
            for i, msg in pending:
                if msg[0] == "stop":
                    if i == 0:
                        if core.trace is not None:
                            core.trace.flush()
                        return
                    chans.close(i)
                    continue
                if msg[0] == "hello":
                    chans.all[i].attached = True
                    replies.setdefault(i, []).append((msg[1], True, None))
                    continue
                if i and msg[0] == "add":
                    for sid in msg[2][0]:
                        chans.owner[sid] = i
                reply = _apply(core, *msg)
                if msg[0] == "abort" or (msg[0] == "add" and not reply[1]):
                    for sid in msg[2] if msg[0] == "abort" else msg[2][0]:
                        chans.owner.pop(sid, None)
                replies.setdefault(i, []).append(reply)
                if core.trace is not None and msg[0] == "add":
                    core.trace.record({"added": msg[2][0], "t0": time.perf_counter() * 1e3})
            if replies:
                snapshot = EngineSnapshot.of(core)
                for i, c in enumerate(chans.all):
                    if i in replies:
                        chans.send(i, ("replies", replies[i], snapshot))
                    elif c.attached:  # what another process's commands changed (gauges, admission)
                        chans.send(i, ("snapshot", snapshot))
            if core.has_unfinished():
                _send_step(chans, _step(core))
                if core.trace is not None:
                    core.trace.annotate_last("t_sent")
                if core.lost is not None:
                    snapshot = EngineSnapshot.of(core)
                    for i in range(len(chans.all)):
                        chans.send(i, ("lost", core.lost, snapshot))
                    raise SystemExit(EXIT_LOST)
    except ChannelGone:
        raise EOFError from None


def _send_step(chans: _Channels, msg: tuple) -> None:
    """A step's outputs (or a fault's aborted sequences) to the channels that own them; every
    attached channel gets the message with its share (maybe none) and the snapshot, so each API
    process hears of every fault."""
    kind, payload, snapshot = msg
    if chans.alone():
        chans.send(0, msg)
        return
    if kind == "step":
        by = chans.split([row[0] for row in payload], payload)
        for row in payload:
            if row[_FINISHED]:
                chans.owner.pop(row[0], None)
    else:  # "fault": the aborted sequences
        by = chans.split(payload, payload)
        for sid in payload:
            chans.owner.pop(sid, None)
    for i, c in enumerate(chans.all):
        if i in by or c.attached:
            chans.send(i, (kind, by.get(i, []), snapshot))


def _apply(core: EngineCore, kind: str, req_id: int, payload: Any) -> tuple[int, bool, Any]:
    try:
        if kind == "add":
            add_all(core, *payload)
            value = None
        elif kind == "abort":
            for sid in payload:
                core.abort(sid)
            value = None
        else:
            value = payload(core)  # "call"
        reply = (req_id, True, value)
    except Exception as e:
        reply = (req_id, False, e)
    try:  # what cannot make the round trip (a call's odd result, an exception with odd args) becomes an error
        pickle.loads(pickle.dumps(reply[2]))
    except Exception as e:
        what = "result" if reply[1] else f"error ({type(reply[2]).__name__}: {reply[2]})"
        reply = (req_id, False, TypeError(f"the {what} of {kind} cannot be sent to the server process: {e}"))
    return reply


def _step(core: EngineCore) -> tuple:
    try:
        outputs = core.step()
    except Exception:
        # A step raised outside the model (the core fails a model fault's requests itself): the
        # state of the sequences in flight is unknown, so fail them all and keep serving.
        seq_ids = list(core.scheduler.seqs)
        log.exception("engine step failed; failing %d in-flight requests", len(seq_ids))
        core.stats.num_step_failures += 1  # counted here, once, whichever API processes held them
        try:
            for sid in seq_ids:
                core.abort(sid)
            snapshot = EngineSnapshot.of(core)
        except Exception:
            log.exception("cleaning up after the failed step failed too")
            snapshot = EngineSnapshot()
        return ("fault", seq_ids, snapshot)
    return ("step", pack_outputs(outputs), EngineSnapshot.of(core))


# -- the parent --------------------------------------------------------------------------------

def settle(pending: dict[int, asyncio.Future], req_id: int, ok: bool, value: Any) -> None:
    """A child's answer to request req_id: its future gets the value, or the exception when not
    ok; an answer whose caller was cancelled (or that came twice) is dropped."""
    fut = pending.pop(req_id, None)
    if fut is None or fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class FrameReader(asyncio.Protocol):
    """Splits a child process's byte stream (multiprocessing Connection frames of pickles) into messages."""

    def __init__(self, on_message: Callable[[tuple], None], on_lost: Callable[[], None]) -> None:
        self._buf = bytearray()
        self._on_message = on_message
        self._on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        messages, pos = [], 0
        while len(buf) - pos >= 4:
            (size,) = struct.unpack_from("!i", buf, pos)
            head = 4
            if size == -1:  # a message over 2 GiB
                if len(buf) - pos < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, pos + 4)
                head = 12
            if len(buf) - pos < head + size:
                break
            try:
                messages.append(pickle.loads(buf[pos + head:pos + head + size]))
            except Exception:
                log.exception("a message from a child process could not be read")
            pos += head + size
        del buf[:pos]
        for msg in messages:
            try:
                self._on_message(msg)
            except Exception:
                log.exception("handling a message from a child process failed")

    def eof_received(self) -> None:
        self._on_lost()

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost()


class ProcessCore:
    """The parent's handle on an EngineCore in a child process (a CoreClient for AsyncEngine).

    spawn() starts the child and wait_ready() blocks until it has built the engine (or raises
    EngineStartError), so a server can print what it serves before it listens; start() (which
    does both if needed) then attaches the pipes to the running event loop. close() stops the
    child; kill() is the synchronous last resort (also registered with atexit)."""

    def __init__(self, build: Build, args: tuple = (), name: str = "pagedserve-engine") -> None:
        self.snapshot = EngineSnapshot()
        self.failure: str | None = None
        self._build, self._args, self._name = build, args, name
        self._state = "new"  # -> spawned -> ready -> running -> closing -> closed; or running -> dead
        self._proc: BaseProcess | None = None
        self._commands: Connection | None = None  # the parent's ends of the two pipes
        self._results: Connection | None = None
        self._writer: asyncio.WriteTransport | None = None
        self._reader: asyncio.ReadTransport | None = None
        self._events: EngineEvents | None = None
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._lost: str | None = None  # why the child's executor was lost, if it said so before exiting
        self.channels: list[tuple[Connection, Connection]] = []  # spawn(api_channels=...)'s, to hand over
        self._attached = False  # attach()'s: another process spawned the child

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._state == "running"

    @classmethod
    def attach(cls, commands: Connection, results: Connection, snapshot: EngineSnapshot) -> "ProcessCore":
        """A client for one of the channels that spawn(api_channels=...) kept, in the API process it
        was handed to: it drives the child as the spawning process does, but neither starts nor
        joins it."""
        core = cls(lambda: None)
        core._commands, core._results, core.snapshot = commands, results, snapshot
        core._state, core._attached = "ready", True
        return core

    def spawn(self, api_channels: int = 0) -> None:
        """Start the child; api_channels: pipes for that many more API processes, whose ends are
        then in self.channels (for ProcessCore.attach) until handed over."""
        ctx = mp.get_context("spawn")
        child_commands, self._commands = ctx.Pipe(duplex=False)
        self._results, child_results = ctx.Pipe(duplex=False)
        more, child_ends = [], []
        for _ in range(api_channels):
            c_child, c_parent = ctx.Pipe(duplex=False)
            r_parent, r_child = ctx.Pipe(duplex=False)
            more.append((c_child, r_child))
            child_ends += [c_child, r_child]
            self.channels.append((c_parent, r_parent))
        proc = ctx.Process(target=child_main, name=self._name, args=(
            child_commands, child_results, self._build, self._args, logging.getLogger().getEffectiveLevel(), more))
        # The child inherits an ignored SIGINT: a Ctrl-C while spawn's bootstrap imports our modules
        # (~0.5-1 s) printed a KeyboardInterrupt traceback from it; child_main then decides what
        # SIGINT means there. The price: a Ctrl-C within start() itself (~1-10 ms) is lost to this
        # process too. Handlers can be swapped only on the main thread; elsewhere the child starts as
        # before.
        swap = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if swap else None
        try:
            proc.start()
        finally:
            if swap:
                signal.signal(signal.SIGINT, previous)
        self._proc = proc
        self._state = "spawned"
        atexit.register(self.kill)
        for conn in (child_commands, child_results, *child_ends):
            conn.close()  # the child has its own copies; ours would hide its death (no EOF)

    def wait_ready(self) -> Any:
        """Block until the child has built the engine; returns what its build function reported."""
        assert self._state == "spawned" and self._results is not None and self._proc is not None
        try:
            msg = self._results.recv()
        except EOFError:
            self._proc.join(5.0)
            self.kill()
            raise EngineStartError(f"the engine process exited during startup ({describe_exit(self._proc.exitcode)})") from None
        except BaseException:
            self.kill()
            raise
        if msg[0] == "error":
            self.kill()
            raise EngineStartError(msg[1])
        _, info, self.snapshot = msg
        self._state = "ready"
        return info

    async def start(self, events: EngineEvents) -> None:
        loop = asyncio.get_running_loop()
        if self._state == "new":
            self.spawn()
        if self._state == "spawned":
            await loop.run_in_executor(None, self.wait_ready)
        if self._state != "ready":
            raise EngineUnavailable(self.failure or "the engine process is not running")
        self._events = events
        self._state = "running"  # before the reader exists: a child that died meanwhile is reported
        self._reader, _ = await loop.connect_read_pipe(lambda: FrameReader(self._on_message, self._on_lost),
                                                       self._results)
        self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, self._commands)
        if self._attached:
            await self._request("hello", None)  # from now on the child sends this channel every step

    def notify(self) -> None:
        pass  # the child steps on its own

    async def add(self, seq_ids: list[int], requests: Seq[tuple[list[int], SamplingParams]]) -> None:
        await self._request("add", (seq_ids, list(requests)))

    async def abort(self, seq_ids: list[int]) -> None:
        await self._request("abort", seq_ids)

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        return await self._request("call", fn)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._state in ("new", "closed"):
            return
        if self._state in ("spawned", "ready"):
            await loop.run_in_executor(None, self.kill)
            return
        if self._state == "running":
            self._state = "closing"
            self._send(("stop",))
        await loop.run_in_executor(None, self._join_or_kill, STOP_TIMEOUT_S)
        self._state = "closed"
        self._close_pipes()
        self._fail_replies("the engine has stopped")
        atexit.unregister(self.kill)

    def kill(self) -> None:
        """Stop the child without an event loop: close the pipes (an idle child exits when it sees
        that), then kill it if it is still there."""
        atexit.unregister(self.kill)
        starting = self._state == "spawned"
        self._state = "closed"
        for conn in (self._commands, self._results, *(c for pair in self.channels for c in pair)):
            if conn is not None and not conn.closed:
                conn.close()
        if starting and self._proc is not None and self._proc.is_alive():
            # Still building the engine (Ctrl-C during start-up): SIGINT ends the build, which never
            # looks at the pipes. Closed first: a child that does not yet take SIGINT sees them closed.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGINT)
            self._join_or_kill(STOP_TIMEOUT_S)
        else:
            self._join_or_kill(2.0)

    # -- internals ---------------------------------------------------------------------------

    def _join_or_kill(self, timeout_s: float) -> None:
        if self._proc is None:
            return
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
            self._proc.kill()
            self._proc.join(5.0)

    def _send(self, msg: tuple) -> None:
        assert self._writer is not None
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        self._writer.write((struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + data)

    async def _request(self, kind: str, payload: Any) -> Any:
        if not self.alive:
            raise EngineUnavailable(self.failure or "the engine process is not running")
        req_id = next(self._ids)
        self._send((kind, req_id, payload))  # raises for an unpicklable payload: nothing to undo
        reply = asyncio.get_running_loop().create_future()
        self._replies[req_id] = reply
        return await reply

    def _on_message(self, msg: tuple) -> None:
        assert self._events is not None
        kind, self.snapshot = msg[0], msg[-1]
        if kind == "step":
            self._events.on_outputs(unpack_outputs(msg[1]))
        elif kind == "replies":
            for req_id, ok, value in msg[1]:
                settle(self._replies, req_id, ok, value)
        elif kind == "fault":
            self._events.on_fault(msg[1])
        elif kind == "lost":
            self._lost = msg[1]

    def _on_lost(self) -> None:
        if self._state == "running":  # otherwise we asked it to stop
            self._state = "dead"
            asyncio.ensure_future(self._report_death())

    async def _report_death(self) -> None:
        assert self._events is not None
        if self._proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 5.0)
        how = "" if self._proc is None else f" ({describe_exit(self._proc.exitcode)})"
        self.failure = (f"the engine stopped: {self._lost}; restart the server" if self._lost is not None else
                        f"the engine process exited unexpectedly{how}; restart the server")
        log.error("%s", self.failure)
        self._close_pipes()
        self._fail_replies(self.failure)
        atexit.unregister(self.kill)
        self._events.on_dead(self.failure)

    def _fail_replies(self, message: str) -> None:
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            if not reply.done():
                reply.set_exception(EngineUnavailable(message))

    def _close_pipes(self) -> None:
        for transport in (self._writer, self._reader):
            if transport is not None:
                transport.close()
        self._writer = self._reader = None
