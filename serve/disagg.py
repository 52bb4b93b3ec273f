"""Prefill/decode disaggregation (`serve run --disaggregate P:D`): P prefill engines and D decode
engines, each in a child process of its own (one GPU each, or sharing the CPU), behind this one
server.

A request's prompt goes to a prefill engine (the one holding the longest cached prefix of it, else
the least loaded: serve/router.py), which computes it and samples the first token; the client gets
that token at once. The prompt's KV pages then move to the least loaded decode engine, which
continues the stream; the client sees one ordinary stream. The decode engine copies the pages
itself from the prefill engine's pool, which it maps at start-up (CUDA IPC between GPUs of this
host, the pool's memory file on the CPU); where it cannot map it, they move by torch.distributed
point-to-point (gloo, NCCL). engine/kv_transfer.py has both; the engines meet in one group whose
rendezvous store the first prefill engine hosts on a port this process picks. The decode engine
asks: it allocates the blocks when it has room, then this process has the prefill engine lend (or
send) and the decode engine copy (or receive) them (scheduler/disagg.py has the protocol). Until
the copy has landed the prompt's blocks stay held on the prefill engine: a full decode engine
pushes back on the prefill engines, whose new prompts then wait for blocks.

Failures: an engine that dies fails its own requests (those it was computing, and those whose KV it
held or was to receive); the router sends it nothing more and /health says "degraded". When no
prefill engine or no decode engine is left the server stops and exits non-zero, as a single
engine's does. Requests with a grammar (structured output) run whole on a prefill engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence as Seq
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from engine.config import EngineConfig
from scheduler.core import EngineCore
from scheduler.disagg import (HANDOFF, DecodeCore, PrefillCore, Received, Sent, TransferStats, kv_copied, receive_kv,
                              release_kv, send_kv)
from scheduler.engine_proc import ProcessCore
from scheduler.loop import (Admission, AsyncEngine, EngineSnapshot, EngineUnavailable, Front, LoopConfig, QueueFull,
                            OutputStream, RequestRecord, unavailable, wait_set)
from scheduler.request import KVTransferParams, SamplingParams, StepOutput
from serve.build import model_folder_config
from serve.engine_process import EngineInfo, build_core
from serve.engine_set import (EngineSet, cpu_threads, enter_place, gpus_per_engine, runs_on_cpu, start_engines,
                              visible_gpus)
from serve.replicas import NullObserver, ReplicaObserver, add_routed, call_running, idle_snapshot, total_snapshot
from serve.router import Router, RouterConfig

log = logging.getLogger("pagedserve")
T = TypeVar("T")
ROLES = ("prefill", "decode")
MAX_TAG = 2**31 - 1
LANDING_POLL_S = 0.001  # a pull lands after the decode engine's step in flight: a step or two of polls


def parse_disaggregate(text: str) -> tuple[int, int]:
    """'P:D' -> (P, D); raises ValueError with a one-line message."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--disaggregate takes PREFILL:DECODE engine counts, e.g. 1:1; got {text!r}")
    p, d = (int(x) for x in parts)
    if p < 1 or d < 1:
        raise ValueError(f"--disaggregate needs at least one prefill and one decode engine; got {text!r}")
    return p, d


# -- placement -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class EnginePlace:
    """Where one engine runs and its place in the engines' group."""

    role: str  # "prefill" | "decode"
    index: int  # within its role
    rank: int  # in the group: prefill engines first
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES: its own GPU first (cuda:0), then the others (for peer copies)
    cpu_threads: int | None

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"

    def describe(self) -> str:
        return f"GPU {self.gpus[0]}" if self.gpus else f"CPU ({self.cpu_threads} threads)"


def place_engines(cfg: EngineConfig, num_prefill: int, num_decode: int, gpus: list[str],
                  cpu_count: int) -> list[EnginePlace]:
    """Prefill engines on the first P GPUs, decode engines on the next D. Raises ValueError (one line)."""
    if gpus_per_engine(cfg) != 1:
        raise ValueError("--disaggregate runs engines of one GPU each: drop --tensor-parallel-size and "
                         "--pipeline-parallel-size")
    n = num_prefill + num_decode
    roles = [("prefill", i) for i in range(num_prefill)] + [("decode", i) for i in range(num_decode)]
    if runs_on_cpu(cfg, gpus):
        threads = cpu_threads(cpu_count, n)
        return [EnginePlace(role, i, rank, (), threads) for rank, (role, i) in enumerate(roles)]
    if n > len(gpus):
        raise ValueError(f"--disaggregate {num_prefill}:{num_decode} needs {n} GPUs; {len(gpus)} are visible")
    used = gpus[:n]
    return [EnginePlace(role, i, rank, (used[rank], *(g for g in used if g != used[rank])), None)
            for rank, (role, i) in enumerate(roles)]


def role_config(cfg: EngineConfig, role: str) -> EngineConfig:
    # a decode engine computes no prompt it could share (a preempted one's, at most)
    return cfg if role == "prefill" else dataclasses.replace(cfg, enable_prefix_caching=False)


def build_engine_role(cfg: EngineConfig, show_progress: bool, place: EnginePlace, num_prefill: int,
                      world_size: int, port: int) -> tuple[EngineCore, EngineInfo]:
    """Runs in the engine's child process, before torch is imported there."""
    enter_place(place)
    try:  # `ps -o comm` and top name the engine: pagedserve-p0, pagedserve-d0, ...
        with open("/proc/self/comm", "w") as f:
            f.write(engine_comm(place))
    except OSError:
        pass
    from engine.kv_transfer import PoolTransport, join_group

    core, info = build_core(role_config(cfg, place.role), show_progress,
                            PrefillCore if place.role == "prefill" else DecodeCore)
    runner = core.executor
    join_group(place.rank, world_size, "127.0.0.1", port, runner.device)
    transport = PoolTransport(runner.pool)
    transport.handshake(range(num_prefill), range(num_prefill, world_size), place.rank)
    core.transport = transport  # type: ignore[attr-defined]
    return core, info


def engine_comm(place: EnginePlace) -> str:
    return f"pagedserve-{place.role[0]}{place.index}"[:15]


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


# -- start-up ----------------------------------------------------------------------------------

@dataclass
class DisaggregatedEngine(EngineSet[EnginePlace]):
    """The started engines, in rank order: prefill engines, then decode engines (create_app builds
    a DisaggregatedSet over them)."""

    @property
    def num_kv_blocks(self) -> int:
        """For the banner: the decode engines' blocks (where the streams' KV lives)."""
        return sum(info.num_blocks for info, p in zip(self.infos, self.places) if p.role == "decode")

    def loop(self, config: LoopConfig) -> "DisaggregatedSet":
        # admission (queue limit, rate) happens once, in the set
        inner = LoopConfig(max(config.max_waiting_requests, 1 << 20), None, config.max_retry_after_s)
        engines = [AsyncEngine(core, inner) for core in self.cores]
        prefill = [e for e, p in zip(engines, self.places) if p.role == "prefill"]
        decode = [e for e, p in zip(engines, self.places) if p.role == "decode"]
        prefill_blocks = tuple(i.num_blocks for i, p in zip(self.infos, self.places) if p.role == "prefill")
        router = Router(RouterConfig(self.config.block_size, prefill_blocks))
        return DisaggregatedSet(prefill, decode, router, config, self.max_model_len)


def start_disaggregated(cfg: EngineConfig, num_prefill: int, num_decode: int, show_progress: bool = True,
                        environ: Mapping[str, str] | None = None) -> DisaggregatedEngine:
    """Start the P + D engine processes and wait until every one has built its engine and joined
    the group. Bad placement or a bad model folder fails before any process starts."""
    environ = os.environ if environ is None else environ
    places = place_engines(cfg, num_prefill, num_decode, visible_gpus(environ), os.cpu_count() or 1)
    path, model_cfg = model_folder_config(cfg, show_progress)
    port = free_port()
    world = len(places)
    cores = [ProcessCore(build_engine_role, (cfg, show_progress and p.rank == 0, p, num_prefill, world, port),
                         name=f"pagedserve-{p.role}-{p.index}") for p in places]
    tokenizer, infos = start_engines(cores, [f"{p.role} engine {p.index}" for p in places], path)
    return DisaggregatedEngine(cores, infos, places, tokenizer, model_cfg, cfg)


# -- serving -----------------------------------------------------------------------------------

class TransferFailed(Exception):
    pass


def _consume(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


class DisaggStream(OutputStream):
    """An OutputStream fed by the set's driver task (push()); abort() stops the unfinished ones."""

    def __init__(self, seq_ids: list[int], on_abort: Callable[[], None]) -> None:
        super().__init__(len(seq_ids))
        self.seq_ids = seq_ids
        self._open = set(range(len(seq_ids)))  # not yet finished as pushed
        self._on_abort = on_abort

    def push(self, index: int, out: StepOutput) -> None:
        if index not in self._open:
            return
        if out.finished:
            self._open.discard(index)
        self._put(index, out)

    @property
    def done(self) -> bool:
        return not self._open

    def abort(self) -> None:
        if self._open:
            self._on_abort()


@dataclass(eq=False)
class _Request:
    stream: DisaggStream
    records: list[RequestRecord]
    prefill: int
    driver: asyncio.Task | None = None


class DisaggregatedSet(Front):
    """Requests in, streams out, over prefill and decode engines' AsyncEngines: what serve/api.py,
    serve/metrics.py and serve/run_cmd.py use of an AsyncEngine, plus per-role state."""

    def __init__(self, prefill: list[AsyncEngine], decode: list[AsyncEngine], router: Router,
                 config: LoopConfig | None = None, max_model_len: int = 1 << 62) -> None:
        self.max_model_len = max_model_len
        self.engines = {"prefill": prefill, "decode": decode}
        self.router = router  # over the prefill engines
        self.config = config or LoopConfig()
        self.observer: ReplicaObserver = NullObserver()
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.failures: dict[str, list[str | None]] = {r: [None] * len(self.engines[r]) for r in ROLES}
        self.transfers = TransferStats()  # the decode engines' receives, all of them
        self.on_transfer: Callable[[Received], None] | None = None  # the metrics' transfer-time histogram
        self._requests: set[_Request] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = False
        self._admission = Admission(self.config)  # its num_adding: sequences on their way to a prefill engine
        self._prompt_tokens = [0] * len(prefill)
        self._tags = itertools.count(1)
        for role in ROLES:
            for i, engine in enumerate(self.engines[role]):
                engine.on_failure = partial(self._engine_failed, role, i)

    @property
    def prefill(self) -> list[AsyncEngine]:
        return self.engines["prefill"]

    @property
    def decode(self) -> list[AsyncEngine]:
        return self.engines["decode"]

    def _all(self) -> list[AsyncEngine]:
        return self.prefill + self.decode

    # -- the AsyncEngine surface -------------------------------------------------------------

    @property
    def snapshot(self) -> EngineSnapshot:
        return total_snapshot([s for role in ROLES for s in self.engine_snapshots(role)])

    @property
    def running(self) -> bool:
        return any(e.running for e in self._all())

    @property
    def accepting(self) -> bool:
        return (self._accepting and any(e.accepting for e in self.prefill)
                and any(e.accepting for e in self.decode))

    @property
    def num_in_flight(self) -> int:
        return sum(len(r.records) for r in self._requests)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self._all()) + self._admission.num_adding

    @property
    def num_loop_faults(self) -> int:
        return sum(e.num_loop_faults for e in self._all())

    async def start(self) -> None:
        if self.running:
            return
        await asyncio.gather(*(e.start() for e in self._all()))
        self._accepting = True

    async def drain(self, timeout_s: float) -> None:
        self._accepting = False
        if self._requests:
            await wait_set(self._idle, timeout_s)
        for req in list(self._requests):
            req.stream.abort()
        drivers = [r.driver for r in self._requests if r.driver is not None]
        if drivers:
            await asyncio.wait(drivers, timeout=5.0)
        await asyncio.gather(*(e.drain(0.0) for e in self._all()))

    async def stop(self) -> None:
        self._accepting = False
        for req in list(self._requests):
            if req.driver is not None:
                req.driver.cancel()
        await asyncio.gather(*(e.stop() for e in self._all()))
        t = self.transfers
        if t.num_transfers:
            log.info("KV moved: %d prompts, %.3f GB; the %.3f GB timed took %.3f s of receiving (%.1f GB/s)",
                     t.num_transfers, t.num_bytes / 1e9, t.timed_bytes / 1e9, t.seconds,
                     t.timed_bytes / 1e9 / max(t.seconds, 1e-9))

    async def add_requests(self, requests: Seq[tuple[list[int], SamplingParams]],
                           received: float | None = None) -> DisaggStream:
        """Admit the sequences of one request (all or none) to one prefill engine. Raises what
        AsyncEngine.add_requests raises."""
        n = len(requests)
        self._check_admissible(n)
        async with self._admission.adding(n):
            tokens = sum(len(ids) for ids, _ in requests)
            prefill_requests = [(ids, self._prefill_params(ids, params)) for ids, params in requests]
            p, inner = await add_routed(self.router, self.prefill, self._prompt_tokens, prefill_requests, self.failure,
                                        self._check_accepting, keep_on_cancel=False)
        now = time.monotonic()
        records = [RequestRecord(sid, now, len(ids), received=received)
                   for sid, (ids, _) in zip(inner.seq_ids, requests)]
        req = _Request(None, records, p)  # type: ignore[arg-type]
        req.stream = DisaggStream(list(inner.seq_ids), lambda: req.driver.cancel() if req.driver else None)
        self._requests.add(req)
        self._idle.clear()
        req.driver = asyncio.ensure_future(self._drive(req, inner, list(requests), tokens))
        return req.stream

    async def call(self, fn: Callable[[EngineCore], T]) -> list[T]:
        """fn(core) on every running engine, prefill engines first (inspection, tests)."""
        return await call_running(self._all(), fn, self.failure)

    def retry_after_s(self) -> int:
        live = [e.retry_after_s() for e in self.prefill if e.running]
        return min(live) if live else 1

    # -- per role ----------------------------------------------------------------------------

    def engine_snapshots(self, role: str) -> list[EngineSnapshot]:
        return [e.snapshot if e.running else idle_snapshot(e.snapshot) for e in self.engines[role]]

    def engine_up(self, role: str) -> list[bool]:
        return [e.running and self.failures[role][i] is None for i, e in enumerate(self.engines[role])]

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for GET /health."""
        engines = []
        for role in ROLES:
            for i, up in enumerate(self.engine_up(role)):
                why = self.failures[role][i]
                engines.append({"role": role, "index": i, "status": "ok" if up else "failed" if why else "stopped",
                                **({"error": why} if why else {})})
        if self.accepting:
            ok = all(all(self.engine_up(role)) for role in ROLES)
            return 200, {"status": "ok" if ok else "degraded", "engines": engines}
        if self.failure:
            return 503, {"status": "failed", "error": self.failure, "engines": engines}
        return 503, {"status": "shutting down" if self.running else "stopped", "engines": engines}

    # -- a request's way ---------------------------------------------------------------------

    def _prefill_params(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """The prefill engine's part: the first token, the prompt's KV held for a decode engine,
        unless the request ends with that token anyway (or has a grammar: then it runs whole)."""
        if params.max_tokens == 1 or params.grammar is not None or len(ids) + 1 >= self.max_model_len:
            return params
        return dataclasses.replace(params, max_tokens=1, kv_transfer=KVTransferParams(hand_off=True))

    async def _drive(self, req: _Request, inner: Any, requests: list[tuple[list[int], SamplingParams]],
                     tokens: int) -> None:
        """Stream the prefill engine's outputs, then each handed-off sequence's decode engine's."""
        handoffs: list[asyncio.Task] = []
        try:
            try:
                async for batch in inner:
                    for index, out in batch:
                        if out.finish_reason != HANDOFF:
                            self._emit(req, index, out)
                            continue
                        out.finished, out.finish_reason = False, None
                        self._emit(req, index, out)
                        ids, params = requests[index]
                        handoffs.append(asyncio.ensure_future(
                            self._decode_one(req, index, inner.seq_ids[index], ids, params, out)))
            finally:
                self._prompt_tokens[req.prefill] -= tokens
            if handoffs:
                await asyncio.gather(*handoffs)
        except asyncio.CancelledError:
            inner.abort()
            for t in handoffs:
                t.cancel()
            if handoffs:
                await asyncio.gather(*handoffs, return_exceptions=True)
        except Exception:
            log.exception("serving a disaggregated request failed")
            inner.abort()
            for t in handoffs:
                t.cancel()
            for index in range(len(req.records)):
                self._fail(req, index, "internal error in the server; the request was not completed")
        finally:
            for index in range(len(req.records)):  # whatever did not finish (aborted) ends now
                self._emit(req, index, StepOutput(req.stream.seq_ids[index], [], True, "abort"))
            self._requests.discard(req)
            if not self._requests:
                self._idle.set()

    async def _decode_one(self, req: _Request, index: int, prefill_sid: int, ids: list[int],
                          params: SamplingParams, first: StepOutput) -> None:
        p = req.prefill
        transfer: asyncio.Future | None = None
        inner = None
        try:
            d = self._pick_decode()
            if d is None:
                self._fail(req, index, self.failure or "no decode engine is serving")
                return
            # the prefill engine's first output carried the prompt's logprobs
            decode_params = dataclasses.replace(params, prompt_logprobs=None,
                                                kv_transfer=KVTransferParams(remote_tokens=len(ids)))
            try:
                inner = await self.decode[d].add_requests([(ids + first.new_token_ids, decode_params)])
            except (EngineUnavailable, QueueFull, ValueError) as e:
                self._fail(req, index, f"decode engine {d}: {e}")
                return
            async for batch in inner:
                for _, out in batch:
                    if transfer is None and not out.new_token_ids and not out.finished:
                        # the decode engine has blocks for it: move the prompt's KV now
                        transfer = asyncio.ensure_future(self._transfer(p, prefill_sid, d, inner.seq_ids[0]))
                        transfer.add_done_callback(_consume)  # it outlives a cancelled request
                        try:
                            await asyncio.shield(transfer)
                        except TransferFailed as e:
                            self._fail(req, index, str(e))
                            return
                        continue
                    out.num_cached_tokens = first.num_cached_tokens
                    self._emit(req, index, out)
        finally:
            if transfer is None:  # the prefill engine still holds the KV: free it
                asyncio.ensure_future(self._release(p, prefill_sid))
            if inner is not None:
                inner.abort()

    async def _transfer(self, p: int, prefill_sid: int, d: int, decode_sid: int) -> None:
        """Send on the prefill engine, then receive on the decode engine: every send that happened
        gets its receive (the pair's transfers match in order), even for a request aborted
        meanwhile. Where the decode engine pulls, the prefill engine only lends the blocks, and
        gets them back once the decode engine's copy has landed (or the copy failed)."""
        tag = next(self._tags) % MAX_TAG
        peer_d, peer_p = len(self.prefill) + d, p
        try:
            sent: Sent = await self.prefill[p].call(partial(send_kv, seq_id=prefill_sid, peer=peer_d, tag=tag))
        except KeyError:
            raise TransferFailed("the prompt's KV was released before it could move") from None
        except Exception as e:
            raise TransferFailed(f"prefill engine {p} could not send the prompt's KV: {e}") from None
        try:
            got: Received = await self.decode[d].call(partial(receive_kv, seq_id=decode_sid, peer=peer_p, tag=tag,
                                                              num_blocks=sent.num_blocks, lent=sent.lent))
            landing = got.landing
            while landing:  # the copy runs after the decode engine's step in flight
                await asyncio.sleep(LANDING_POLL_S)
                landing = not await self.decode[d].call(partial(kv_copied, tag=tag))
        except Exception as e:
            raise TransferFailed(f"decode engine {d} could not receive the prompt's KV: {e}") from None
        finally:
            if sent.lent is not None:
                await self._release(p, prefill_sid)
            self._notify(self.prefill[p], self.decode[d])  # blocks were freed, a sequence was added
        t = self.transfers
        t.num_transfers += 1
        t.num_bytes += got.num_bytes
        t.add_timed(got.timed)
        if self.on_transfer is not None:
            self.on_transfer(got)

    async def _release(self, p: int, prefill_sid: int) -> None:
        try:
            await self.prefill[p].call(partial(release_kv, seq_id=prefill_sid))
            self._notify(self.prefill[p])
        except Exception:
            pass  # the engine is gone, and its blocks with it

    @staticmethod
    def _notify(*engines: AsyncEngine) -> None:
        """A call changed what an engine can do: one stepping on a thread of this process looks
        again (an engine process looks after every command by itself)."""
        for e in engines:
            if e.running:
                e.client.notify()

    def _pick_decode(self) -> int | None:
        live = [i for i, e in enumerate(self.decode) if e.accepting and self.failures["decode"][i] is None]
        return min(live, key=lambda i: (self.decode[i].num_in_flight, i)) if live else None

    def _emit(self, req: _Request, index: int, out: StepOutput) -> None:
        stream = req.stream
        if index not in stream._open:
            return
        rec = req.records[index]
        now = time.monotonic()
        if out.new_token_ids and rec.first_token is None:
            rec.first_token = now
        rec.num_output_tokens = out.num_output_tokens or rec.num_output_tokens + len(out.new_token_ids)
        out.seq_id = stream.seq_ids[index]
        stream.push(index, out)
        if out.finished:
            rec.finish, rec.finish_reason = now, out.finish_reason
            self.observer.request_finished(rec)

    def _fail(self, req: _Request, index: int, message: str) -> None:
        self._emit(req, index, StepOutput(req.stream.seq_ids[index], [], True, "error", error=message))

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise unavailable(self.failure, self.running)

    def _engine_failed(self, role: str, index: int, message: str) -> None:
        self.failures[role][index] = message
        if role == "prefill":
            self.router.remove(index)
        left = sum(self.engine_up(role))
        log.error("%s engine %d failed (%s); %d of %d %s engines serve on", role, index, message, left,
                  len(self.engines[role]), role)
        if left == 0 and self.failure is None:
            self.failure = f"every {role} engine has failed; the last: {message}"
            self._accepting = False
            if self.on_failure is not None:
                self.on_failure(self.failure)
