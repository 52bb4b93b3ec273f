"""AsyncEngine: drives a synchronous EngineCore from asyncio.

The AsyncEngine owns the requests (admission, streams, records); a CoreClient owns the core. Two
clients: ThreadCore (here) runs each EngineCore call on one worker thread of this process, and a
background task runs the step loop; ProcessCore (scheduler/engine_proc.py) runs the core in a
child process with its own step loop. Either way core calls (add, abort, a test's inspection)
run in order, between steps, and the core is never touched by two threads at once.

Admission: a request is refused with QueueFull when the sequences waiting for the engine (queued in
the core, being added, or held by the optional asyncio-throttle rate limiter) would exceed
max_waiting_requests. A request's outputs reach its RequestStream, an async iterator; a consumer
that falls behind gets the outputs of several steps merged into one.

Torch-free, like the rest of scheduler/.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Protocol, TypeVar

from asyncio_throttle import Throttler

from scheduler.core import EngineCore
from scheduler.request import SamplingParams, StepOutput, next_seq_id
from scheduler.trace import StepTrace

log = logging.getLogger("pagedserve")
T = TypeVar("T")


API_TRACE_ENV = "PAGEDSERVE_API_TRACE"  # a file for AsyncEngine's trace (bench/README.md)


class QueueFull(Exception):
    """Too many requests are waiting; retry after retry_after_s seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(Exception):
    """The engine is not running (not started yet, shutting down, or stopped)."""


@dataclass(frozen=True)
class LoopConfig:
    max_waiting_requests: int = 1024
    max_request_rate: float | None = None  # sequences admitted per second; None = no rate limit
    max_retry_after_s: int = 60

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1; got {self.max_waiting_requests}")
        if self.max_request_rate is not None and not self.max_request_rate > 0:
            raise ValueError(f"max_request_rate must be > 0; got {self.max_request_rate}")


@dataclass(frozen=True)
class EngineSnapshot:
    """The core's gauges and counters, read where the core runs, after each step."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 1
    num_free_blocks: int = 1
    num_steps: int = 0
    num_preemptions: int = 0
    num_step_failures: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    has_unfinished: bool = False
    hold_wait_s: float = 0.0  # EngineCore.hold_wait() after the step
    # the host tier of the prefix cache (kvcache/host_tier.py); None without one
    prefix_cache_host_hits: int | None = None  # prompt tokens found there (of prefix_cache_hits)
    kv_offload_bytes_out: int | None = None  # KV bytes copied device -> host
    kv_offload_bytes_in: int | None = None  # KV bytes copied host -> device
    host_kv_used_blocks: int | None = None
    host_kv_total_blocks: int | None = None
    # speculative decoding (scheduler/ngram.py): draft tokens verified, and of them accepted; None without it
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    spec_drafts: int | None = None  # drafts verified (a sequence's draft in a step)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def __reduce__(self) -> tuple:
        # The engine process sends one after every step: as its field values, it pickles several
        # times faster than a dataclass's state dict.
        return EngineSnapshot, _snapshot_values(self)

    @classmethod
    def of(cls, core: EngineCore) -> "EngineSnapshot":
        stats, sched, bm = core.stats, core.scheduler, core.block_manager

        def counter(name: str) -> int | None:  # the prefix cache's counters, wherever they live
            for owner in (stats, sched, bm):
                value = getattr(owner, name, None)
                if isinstance(value, int):
                    return value
            return None

        host = getattr(bm, "host", None)
        tier = () if host is None else (sched.prefix_cache_host_hits, bm.num_blocks_out * host.block_bytes,
                                        bm.num_blocks_in * host.block_bytes, host.num_used, host.num_slots)
        return cls(len(sched.running), len(sched.waiting), bm.num_blocks, bm.num_free_blocks,
                   stats.num_steps, stats.num_preemptions, stats.num_step_failures, stats.prompt_tokens,
                   stats.generation_tokens, counter("prefix_cache_queries"), counter("prefix_cache_hits"),
                   core.has_unfinished(), core.hold_wait(), *(tier or (None,) * 5),
                   *((sched.num_draft_tokens, sched.num_accepted_tokens, sched.num_drafts)
                     if getattr(sched, "speculating", False) else ()))


_snapshot_values = attrgetter(*(f.name for f in fields(EngineSnapshot)))


@dataclass
class RequestRecord:
    """One sequence's life, for metrics. Times are time.monotonic() seconds."""

    seq_id: int
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    added: float | None = None  # the engine has taken it
    finish: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    received: float | None = None  # the HTTP request came in (before its body was read and planned)


class LoopObserver(Protocol):
    def request_finished(self, record: RequestRecord) -> None: ...
    def request_rejected(self, reason: str) -> None: ...


class _NullObserver:
    def request_finished(self, record: RequestRecord) -> None:
        pass

    def request_rejected(self, reason: str) -> None:
        pass


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """b's step after a's, as one output."""
    return StepOutput(a.seq_id, a.new_token_ids + b.new_token_ids, b.finished, b.finish_reason,
                      a.new_text + b.new_text, a.logprobs + b.logprobs, b.error or a.error,
                      b.num_prompt_tokens or a.num_prompt_tokens, b.num_output_tokens or a.num_output_tokens,
                      b.num_cached_tokens or a.num_cached_tokens,
                      a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                      a.embedding if a.embedding is not None else b.embedding)


class OutputStream:
    """The outputs of one HTTP request's sequences (n choices, several prompts), by sequence index.

    `async for batch in stream` yields, per iteration, a non-empty list of (index, StepOutput):
    everything that arrived since the last iteration, merged per sequence. Iteration ends once
    every sequence has finished. Subclasses feed it with _put() and say how abort() works.

    A list and one future for the waiting consumer, not an asyncio.Queue: every streamed token
    passes here, and the queue's getter bookkeeping cost more than the rest of the hand-over.
    Fed and read on the event loop only.
    """

    def __init__(self, num_seqs: int) -> None:
        self._outputs: list[tuple[int, StepOutput]] = []
        self._waiter: asyncio.Future[None] | None = None
        self._unfinished = set(range(num_seqs))

    def _put(self, index: int, out: StepOutput) -> None:
        self._outputs.append((index, out))
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: its consumer was cancelled while it waited
                waiter.set_result(None)

    @property
    def done(self) -> bool:
        """Every sequence's last output has been handed out."""
        return not self._unfinished and not self._outputs

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> list[tuple[int, StepOutput]]:
        if not self._outputs:
            if not self._unfinished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        got, self._outputs = self._outputs, []
        merged: dict[int, StepOutput] = {}
        for index, out in got:
            prev = merged.get(index)
            merged[index] = out if prev is None else merge_outputs(prev, out)
            if out.finished:
                self._unfinished.discard(index)
        return list(merged.items())

    def abort(self) -> None:
        raise NotImplementedError


class RequestStream(OutputStream):
    """An OutputStream fed by one AsyncEngine. abort() stops the unfinished sequences (idempotent)."""

    def __init__(self, engine: "AsyncEngine", seq_ids: list[int]) -> None:
        super().__init__(len(seq_ids))
        self._engine = engine
        self.seq_ids = seq_ids
        self._index = {sid: i for i, sid in enumerate(seq_ids)}
        self._live = set(seq_ids)  # not yet finished as far as the engine side knows

    def _push(self, out: StepOutput) -> None:
        if out.finished:
            self._live.discard(out.seq_id)
        self._put(self._index[out.seq_id], out)

    def abort(self) -> None:
        if self._live:
            self._engine.abort(list(self._live))
            self._live.clear()


async def wait_set(event: asyncio.Event, timeout_s: float) -> None:
    """Until event is set, for timeout_s seconds at most."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass


def _ms(t: float | None) -> float | None:
    return None if t is None else t * 1e3


def unavailable(failure: str | None, running: bool) -> EngineUnavailable:
    """Why an engine (or a set of them) takes no request: its failure, else shutting down or not started."""
    return EngineUnavailable(failure or ("the server is shutting down" if running else "the engine is not running"))


class Admission:
    """The limits add_requests applies before a request's sequences go on: the queue limit
    (QueueFull, with a retry-after) and the optional rate limit (asyncio-throttle). num_adding
    counts the sequences admitted and not yet handed on, for the owner's num_waiting."""

    def __init__(self, config: LoopConfig) -> None:
        self.config = config
        self.num_adding = 0
        rate = config.max_request_rate
        self._throttler = None if rate is None else Throttler(rate_limit=max(1, math.ceil(rate)),
                                                             period=max(1, math.ceil(rate)) / rate)

    def check_room(self, n: int, num_waiting: int, observer: LoopObserver, retry_after_s: Callable[[], int]) -> None:
        """Raise QueueFull (told to the observer) when n more sequences would make more than
        max_waiting_requests wait."""
        if num_waiting + n > self.config.max_waiting_requests:
            observer.request_rejected("queue_full")
            raise QueueFull(f"the server is at capacity ({num_waiting} requests waiting); retry later",
                            retry_after_s())

    @asynccontextmanager
    async def adding(self, n: int) -> AsyncIterator[None]:
        """Wait until the rate limit lets n sequences in; they count in num_adding from now until
        the block ends."""
        self.num_adding += n
        try:
            if self._throttler is not None:
                for _ in range(n):
                    await self._throttler.acquire()
            yield
        finally:
            self.num_adding -= n


class Front:
    """What the engine fronts share (AsyncEngine; serve/replicas.py's and serve/disagg.py's sets):
    a request's sequences are admitted together, after the same checks. A front has an Admission
    (_admission), an observer, num_waiting, retry_after_s() and _check_accepting()."""

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> OutputStream:
        return await self.add_requests([(prompt_token_ids, params)])

    async def add_requests(self, requests: Seq[tuple[list[int], SamplingParams]],
                           received: float | None = None) -> OutputStream:
        """received: when the request reached the server (time.monotonic()), for the API trace."""
        raise NotImplementedError

    def _check_admissible(self, n: int) -> None:
        """Before n sequences of one request go on: ValueError for none, EngineUnavailable while
        not accepting, QueueFull past the queue limit."""
        if n == 0:
            raise ValueError("no sequences to add")
        self._check_accepting()
        self._admission.check_room(n, self.num_waiting, self.observer, self.retry_after_s)


def add_all(core: EngineCore, seq_ids: Seq[int], requests: Seq[tuple[list[int], SamplingParams]]) -> None:
    """Add the sequences to the core, all or none (raises the core's RequestRejected)."""
    added = []
    try:
        for sid, (ids, params) in zip(seq_ids, requests):
            core.add_request(ids, params, seq_id=sid)
            added.append(sid)
    except BaseException:
        for sid in added:
            core.abort(sid)
        raise


class EngineEvents(Protocol):
    """What a CoreClient reports to its AsyncEngine, on the event loop."""

    def on_outputs(self, outputs: list[StepOutput]) -> None: ...
    def on_fault(self, seq_ids: list[int]) -> None: ...  # a step raised outside the model; these were aborted
    def on_dead(self, message: str) -> None: ...  # the core is gone for good
    def in_flight(self) -> list[int]: ...


class CoreClient(Protocol):
    """The AsyncEngine's handle on an EngineCore. `snapshot` is the core's latest state."""

    snapshot: EngineSnapshot

    @property
    def alive(self) -> bool: ...  # started, not closed, not dead
    async def start(self, events: EngineEvents) -> None: ...
    def notify(self) -> None: ...  # work was added: step until the core has nothing unfinished
    async def add(self, seq_ids: list[int], requests: Seq[tuple[list[int], SamplingParams]]) -> None: ...
    async def abort(self, seq_ids: list[int]) -> None: ...
    async def call(self, fn: Callable[[EngineCore], T]) -> T: ...
    async def close(self) -> None: ...


class ThreadCore:
    """The core on one worker thread of this process; an asyncio task drives the steps."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.snapshot = EngineSnapshot()
        self._events: EngineEvents | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, events: EngineEvents) -> None:
        self._events = events
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self.snapshot = await self._on_worker(EngineSnapshot.of, self.core)
        self._task = asyncio.create_task(self._run(), name="engine-step-loop")

    def notify(self) -> None:
        self._wake.set()  # the step the loop submits next queues behind the add submitted now

    async def add(self, seq_ids: list[int], requests: Seq[tuple[list[int], SamplingParams]]) -> None:
        self.snapshot = await self._on_worker(self._add_on_worker, seq_ids, requests)

    async def abort(self, seq_ids: list[int]) -> None:
        self.snapshot = await self._on_worker(self._abort_on_worker, seq_ids)

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        return await self._on_worker(fn, self.core)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if pool is not None and hasattr(getattr(self.core, "executor", None), "close"):
            # after the step that may still run on the pool's thread: the executor's ranks follow
            # one thread's calls (tensor parallel)
            await asyncio.get_running_loop().run_in_executor(None, lambda: (pool.shutdown(wait=True), self.core.close()))

    def _on_worker(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._pool is None:
            raise EngineUnavailable("the engine is not running")
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _add_on_worker(self, seq_ids: list[int], requests: Seq[tuple[list[int], SamplingParams]]) -> EngineSnapshot:
        add_all(self.core, seq_ids, requests)
        return EngineSnapshot.of(self.core)

    def _abort_on_worker(self, seq_ids: list[int]) -> EngineSnapshot:
        for sid in seq_ids:
            self.core.abort(sid)
        return EngineSnapshot.of(self.core)

    def _fault_on_worker(self, seq_ids: list[int]) -> EngineSnapshot:
        self.core.stats.num_step_failures += 1  # the core counts every failed step, as the engine process does
        return self._abort_on_worker(seq_ids)

    def _step_on_worker(self) -> tuple[list[StepOutput], EngineSnapshot]:
        outputs = self.core.step() if self.core.has_unfinished() else []
        return outputs, EngineSnapshot.of(self.core)

    async def _run(self) -> None:
        assert self._events is not None
        while True:
            if not self.snapshot.has_unfinished:
                await self._wake.wait()
            elif self.snapshot.hold_wait_s > 0:  # new prompts held for their burst: until more come or it ends
                try:
                    await asyncio.wait_for(self._wake.wait(), self.snapshot.hold_wait_s)
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            try:
                outputs, self.snapshot = await self._on_worker(self._step_on_worker)
                self._events.on_outputs(outputs)
                if getattr(self.core, "lost", None) is not None:  # every request failed with it: the engine stops
                    self._events.on_dead(f"the engine stopped: {self.core.lost}; restart the server")
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                await self._recover()

    async def _recover(self) -> None:
        """A step raised outside the model (the core fails a model fault's requests itself): the
        state of the sequences in flight is unknown, so fail them all and keep serving."""
        assert self._events is not None
        seq_ids = self._events.in_flight()
        log.exception("engine step failed; failing %d in-flight requests", len(seq_ids))
        try:
            self.snapshot = await self._on_worker(self._fault_on_worker, seq_ids)
        except Exception:
            log.exception("cleaning up after the failed step failed too")
            self.snapshot = EngineSnapshot()
        self._events.on_fault(seq_ids)


class AsyncEngine(Front):
    """Requests in, streams out, over a CoreClient: an EngineCore given directly runs on a
    ThreadCore; pass a ProcessCore (scheduler/engine_proc.py) to run it in a child process."""

    def __init__(self, core: EngineCore | CoreClient, config: LoopConfig | None = None,
                 observer: LoopObserver | None = None, seq_ids: Iterator[int] | None = None) -> None:
        """seq_ids: where this loop's sequence ids come from (default: the process's counter); API
        processes that share one engine take disjoint ones."""
        self.client: CoreClient = ThreadCore(core) if isinstance(core, EngineCore) else core
        self._next_id: Callable[[], int] = next_seq_id if seq_ids is None else seq_ids.__next__
        self.core = core if isinstance(core, EngineCore) else None  # thread mode only (tests patch it)
        self.config = config or LoopConfig()
        self.observer = observer or _NullObserver()
        self.num_loop_faults = 0
        self.failure: str | None = None  # why the engine died, once it has
        self.on_failure: Callable[[str], None] | None = None  # told why, once the engine has died (serve run exits)
        self._idle = asyncio.Event()
        self._accepting = False
        self._streams: dict[int, RequestStream] = {}
        self._records: dict[int, RequestRecord] = {}
        # traced requests that finished before their add returned (an engine process's outputs can
        # overtake the add's reply): their trace rows wait for the time the add returned
        self._untraced: dict[int, RequestRecord] = {}
        self._admission = Admission(self.config)  # its num_adding: sequences between admission and the core
        self._finish_times: deque[float] = deque(maxlen=512)
        self._trace = StepTrace.from_env(API_TRACE_ENV)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def snapshot(self) -> EngineSnapshot:
        return self.client.snapshot

    @property
    def running(self) -> bool:
        return self.client.alive

    @property
    def accepting(self) -> bool:
        return self._accepting and self.running

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Sequences admitted but not yet running: in the core's queue or on their way to it."""
        return self.snapshot.num_waiting + self._admission.num_adding

    async def start(self) -> None:
        if self.running:
            return
        await self.client.start(self)
        self._accepting = True

    async def drain(self, timeout_s: float) -> None:
        """Stop admission; let in-flight requests finish for up to timeout_s seconds, then abort
        the rest (their streams end with finish_reason "abort")."""
        self._accepting = False
        if self._streams:
            await wait_set(self._idle, timeout_s)
        if self._streams:
            log.warning("shutdown: aborting %d unfinished requests", len(self._streams))
            await self._abort_now(list(self._streams))

    async def stop(self) -> None:
        self._accepting = False
        await self.client.close()
        for sid in list(self._streams):
            self._finish_stream(StepOutput(sid, [], True, "abort"))
        if self._trace is not None:
            self._trace.flush()

    # -- requests ----------------------------------------------------------------------------

    async def add_requests(self, requests: Seq[tuple[list[int], SamplingParams]],
                           received: float | None = None) -> RequestStream:
        """Admit sequences together (all or none). Raises QueueFull, EngineUnavailable, or the
        core's RequestRejected (a ValueError) when a sequence can never be served."""
        n = len(requests)
        self._check_admissible(n)
        async with self._admission.adding(n):
            self._check_accepting()  # again: the rate limit may have held it while the engine stopped
            seq_ids = [self._next_id() for _ in range(n)]
            stream = RequestStream(self, seq_ids)
            now = time.monotonic()
            for sid, (ids, _) in zip(seq_ids, requests):
                self._streams[sid] = stream
                self._records[sid] = RequestRecord(sid, now, len(ids), received=received)
            self._idle.clear()
            self.client.notify()
            try:
                await self.client.add(seq_ids, requests)
                if self._trace is not None:
                    added = time.monotonic()
                    for sid in seq_ids:
                        if (rec := self._records.get(sid)) is not None:
                            rec.added = added
                        elif (rec := self._untraced.pop(sid, None)) is not None:
                            rec.added = added
                            self._trace_request(rec)
            except asyncio.CancelledError:
                self.abort(seq_ids)  # runs after the add in the core: nothing is left behind
                for sid in seq_ids:
                    if (rec := self._untraced.pop(sid, None)) is not None:
                        self._trace_request(rec)
                raise
            except BaseException:
                for sid in seq_ids:
                    self._forget(sid)
                    self._untraced.pop(sid, None)
                raise
            return stream

    def abort(self, seq_ids: Seq[int]) -> None:
        """Stop these sequences (fire and forget). Their streams end with finish_reason "abort";
        their KV blocks are free once the current step ends."""
        live = [sid for sid in seq_ids if sid in self._streams]
        if live and self.running:
            asyncio.ensure_future(self._abort_now(live))

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run fn(core) between steps (inspection, tests, fault injection). In process mode fn runs
        in the engine process: it must be picklable (a module-level function) and so must its result."""
        if not self.running:
            raise EngineUnavailable(self.failure or "the engine is not running")
        return await self.client.call(fn)

    def retry_after_s(self) -> int:
        """Seconds until the waiting queue has likely drained, from the recent finish rate."""
        now = time.monotonic()
        recent = [t for t in self._finish_times if now - t < 10.0]
        if len(recent) < 2:
            return 1
        rate = len(recent) / max(now - recent[0], 1e-3)
        return max(1, min(self.config.max_retry_after_s, math.ceil(self.num_waiting / rate)))

    # -- EngineEvents: the client's reports ---------------------------------------------------

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        if self._trace is not None:
            self._trace.begin()
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.seq_id)
            if stream is None:
                continue  # aborted while the step ran
            rec = self._records[out.seq_id]
            if out.new_token_ids and rec.first_token is None:
                rec.first_token = now
            rec.num_output_tokens = out.num_output_tokens or rec.num_output_tokens + len(out.new_token_ids)
            if out.finished:
                self._finish_stream(out, now)
            else:
                stream._push(out)
        if self._trace is not None:
            self._trace.mark("t_end", outputs=len(outputs))
            self._trace.end()

    def on_fault(self, seq_ids: list[int]) -> None:
        self.num_loop_faults += 1
        self._fail(seq_ids, "internal error in the engine; the request was not completed")

    def on_dead(self, message: str) -> None:
        self.failure = message
        self._accepting = False
        self._fail(list(self._streams), message)
        if self.on_failure is not None:
            self.on_failure(message)

    def in_flight(self) -> list[int]:
        return list(self._streams)

    # -- internals ---------------------------------------------------------------------------

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise unavailable(self.failure, self.running)

    async def _abort_now(self, seq_ids: list[int]) -> None:
        try:
            await self.client.abort(seq_ids)
        except EngineUnavailable:
            pass  # the core is gone, and the sequences with it
        except Exception:
            log.exception("aborting requests failed")
        for sid in seq_ids:
            if sid in self._streams:
                self._finish_stream(StepOutput(sid, [], True, "abort"))

    def _fail(self, seq_ids: list[int], message: str) -> None:
        for sid in seq_ids:
            if sid in self._streams:
                self._finish_stream(StepOutput(sid, [], True, "error", error=message))

    def _finish_stream(self, out: StepOutput, now: float | None = None) -> None:
        stream = self._streams.get(out.seq_id)
        rec = self._forget(out.seq_id)
        if rec is not None:
            rec.finish = now or time.monotonic()
            rec.finish_reason = out.finish_reason
            self._finish_times.append(rec.finish)
            self.observer.request_finished(rec)
            if self._trace is not None:
                if rec.added is None:
                    self._untraced[rec.seq_id] = rec
                else:
                    self._trace_request(rec)
        if stream is not None:
            stream._push(out)

    def _trace_request(self, rec: RequestRecord) -> None:
        assert self._trace is not None
        self._trace.record({"request": rec.seq_id, "received": _ms(rec.received), "t0": _ms(rec.arrival),
                            "added": _ms(rec.added), "first": _ms(rec.first_token), "t_end": _ms(rec.finish)})

    def _forget(self, sid: int) -> RequestRecord | None:
        self._streams.pop(sid, None)
        if not self._streams:
            self._idle.set()
        return self._records.pop(sid, None)
