"""Drive the load: send the requests on their arrival schedule, at most `concurrency` in flight.

In one process (`LoadPlan.processes` 1), or in several client processes, so that the client's own
CPU (13-30 us per streamed event, by machine and server) does not cap what it can measure. Across
processes:
- the processes take requests in index order from one shared counter, each only when it has a
  free slot of its share of the concurrency (the shares sum to the cap): at most `concurrency` in
  flight overall, and a finished request's slot goes at once to the next one, in whichever process;
  with uneven lengths no process idles while requests remain;
- every request waits for its own arrival offset after one common start (time.perf_counter is
  CLOCK_MONOTONIC on Linux, one clock for every process; checked at start-up);
- each finished result comes back over a queue: the parent advances the progress bar and puts the
  results back in request order.
"""
from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

import aiohttp
from tqdm import tqdm

from bench.client import CompletionTarget, RequestResult, list_models, stream_completion
from bench.workload import BenchRequest, Conversation

STREAMS_PER_PROCESS = 32  # auto: one client process per 32 concurrent streams (see auto_client_processes)
MAX_AUTO_PROCESSES = 4
START_MARGIN_S = 0.05  # the common start lies this far ahead of the "go", so every process is awake for it
STARTUP_TIMEOUT_S = 60.0
POLL_S = 0.02


@dataclass(frozen=True)
class LoadPlan:
    arrivals: list[float]  # seconds after the start, one per request (bench.workload.arrival_offsets)
    concurrency: int | None = None  # None: no cap (closed loop when arrivals are all 0)
    progress: bool = True
    request_timeout_s: float = 6 * 3600.0
    processes: int = 1  # client processes; 1: this process alone


@dataclass(frozen=True)
class ProcessUsage:
    """One client process's CPU time over its part of the run."""

    cpu_s: float
    span_s: float  # the common start -> its last response finished

    @property
    def busy(self) -> float:
        return self.cpu_s / self.span_s if self.span_s > 0 else 0.0


@dataclass
class LoadResult:
    results: list[RequestResult]  # in request order
    duration_s: float  # first request sent -> last response finished
    usage: list[ProcessUsage] = field(default_factory=list)  # one per client process
    # time.perf_counter() when the run started (a result's start_s counts from it): the system's
    # monotonic clock on Linux, which the engine's step trace (scheduler/trace.py) also reads
    clock_start: float = 0.0

    @property
    def client_processes(self) -> int:
        return len(self.usage)

    @property
    def client_cpu_fraction(self) -> float:
        """The busiest client process's CPU time over its span: near 1, that process is the bottleneck."""
        return max((u.busy for u in self.usage), default=0.0)


class LoadError(RuntimeError):
    """A client process failed or died; the message is one line."""


def auto_client_processes(concurrency: int | None, num_requests: int, cpus: int | None = None) -> int:
    """The default for --client-processes: one process per STREAMS_PER_PROCESS requests that can be
    in flight, at most MAX_AUTO_PROCESSES and half the CPUs (the rest for a server on the same host).

    On an H100, 64 streams of a small model (~35-46k events/s) kept one client process 70-78%
    busy: 32 streams a process leaves it about half idle. Fewer streams stay in one process, which
    is today's path."""
    cpus = cpus if cpus is not None else _cpu_count()
    streams = min(concurrency or num_requests, num_requests)
    wanted = -(-streams // STREAMS_PER_PROCESS)
    return max(1, min(wanted, MAX_AUTO_PROCESSES, cpus // 2))


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def client_process_count(processes: int, concurrency: int | None, num_requests: int) -> int:
    """The processes a run uses: no more than requests may be in flight, so each has a slot."""
    return max(1, min(processes, concurrency or num_requests, num_requests))


def split_slots(total: int, processes: int) -> list[int]:
    """total slots over processes as evenly as possible (the first ones get the remainder)."""
    return [total // processes + (1 if w < total % processes else 0) for w in range(processes)]


def _session(limit: int, timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def run_load(target: CompletionTarget, requests: list[BenchRequest], plan: LoadPlan) -> LoadResult:
    if len(plan.arrivals) != len(requests):
        raise ValueError("one arrival offset per request")
    if plan.processes < 1:
        raise ValueError(f"processes must be >= 1, got {plan.processes}")
    processes = client_process_count(plan.processes, plan.concurrency, len(requests))
    if processes > 1:
        cap = min(plan.concurrency or len(requests), len(requests))
        return await _run_in_processes(target, requests, plan, split_slots(cap, processes))
    return await _run_here(target, requests, plan)


async def _run_here(target: CompletionTarget, requests: list[BenchRequest], plan: LoadPlan) -> LoadResult:
    limit = plan.concurrency or len(requests)
    slots = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    # disable=None: tqdm draws only on a terminal
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=None if plan.progress else True)
    async with _session(limit, plan.request_timeout_s) as session:
        start = time.perf_counter()
        cpu_start = time.process_time()

        async def one(request: BenchRequest) -> RequestResult:
            try:
                return await stream_completion(session, target, request, start)
            finally:
                if slots is not None:
                    slots.release()
                bar.update(1)

        tasks = []
        for request, offset in zip(requests, plan.arrivals):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    bar.close()
    return LoadResult(results=list(results), duration_s=duration, usage=[ProcessUsage(cpu, duration)],
                      clock_start=start)


# --- several client processes -------------------------------------------------------------------

@dataclass(frozen=True)
class _Job:
    """What one client process is given (pickled to it at its start)."""

    worker: int
    slots: int
    target: CompletionTarget
    requests: list[BenchRequest]  # all of them: any process may take any request
    arrivals: list[float]
    request_timeout_s: float


@dataclass(frozen=True)
class _Shared:
    """The processes' common state. Messages to the parent: ("ready", worker, perf_counter),
    ("result", position, RequestResult), ("done", worker, ProcessUsage), ("error", worker, text)."""

    messages: Any  # multiprocessing.Queue
    next_position: Any  # multiprocessing.Value("q"): the next request to send, over all processes
    start: Any  # multiprocessing.Value("d"): the common start, set before `go`
    go: Event


def _take(counter: Any) -> int:
    with counter.get_lock():
        position = counter.value
        counter.value = position + 1
    return position


def _worker_main(job: _Job, shared: _Shared) -> None:
    # Ctrl-C reaches the whole process group: the parent stops us. We started with SIGINT blocked
    # (see _start_with_sigint_blocked); ignored first, then unblocked: one that came meanwhile is dropped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _socket_buffers_on_the_heap()
    try:
        usage = asyncio.run(_worker_load(job, shared))
    except BaseException as e:  # noqa: BLE001 - anything goes back to the parent as one line
        text = " ".join(f"{type(e).__name__}: {e}".split())
        shared.messages.put(("error", job.worker, text))
        raise SystemExit(1) from None
    shared.messages.put(("done", job.worker, usage))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _socket_buffers_on_the_heap() -> None:
    """asyncio reads a socket into a fresh 256 KiB bytes object and shrinks it to what came. glibc
    serves allocations above its mmap threshold (128 KiB, until freeing a larger block raises it)
    with mmap, so in a fresh process every read cost an mmap, an mremap and a munmap: 23-29 against
    14-17 us of client CPU per streamed event (measured, two processes on a 2-core machine). A fixed
    1 MiB threshold keeps those buffers on the heap. Elsewhere than glibc: nothing to do."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _wait_for_go(go: Event) -> None:
    parent = multiprocessing.parent_process()
    while not go.wait(0.5):
        if parent is not None and not parent.is_alive():
            raise RuntimeError("the parent process is gone")


async def _worker_load(job: _Job, shared: _Shared) -> ProcessUsage:
    slots = asyncio.Semaphore(job.slots)
    async with _session(job.slots, job.request_timeout_s) as session:
        shared.messages.put(("ready", job.worker, time.perf_counter()))
        await asyncio.to_thread(_wait_for_go, shared.go)
        start = shared.start.value
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        cpu_start = time.process_time()

        async def one(position: int) -> None:
            try:
                result = await stream_completion(session, job.target, job.requests[position], start)
            finally:
                slots.release()
            shared.messages.put(("result", position, result))

        tasks = []
        while True:
            # a slot first, then a request: a process never holds a request it cannot send
            await slots.acquire()
            position = _take(shared.next_position)
            if position >= len(job.requests):
                break
            delay = start + job.arrivals[position] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(position)))
        await asyncio.gather(*tasks)
        return ProcessUsage(cpu_s=time.process_time() - cpu_start, span_s=time.perf_counter() - start)


@dataclass
class _Collector:
    """The parent's side: reads the messages, watches the processes."""

    shared: _Shared
    processes: list[BaseProcess]
    results: list[RequestResult | None]
    bar: tqdm
    spawned_at: float
    ready: set[int] = field(default_factory=set)
    usage: dict[int, ProcessUsage] = field(default_factory=dict)

    def poll(self) -> None:
        # exit codes before the messages: a process that exited has flushed its queue
        exited = [(w, p.exitcode) for w, p in enumerate(self.processes) if p.exitcode is not None]
        while True:
            try:
                kind, who, body = self.shared.messages.get_nowait()
            except queue.Empty:
                break
            self._handle(kind, who, body)
        for w, code in exited:
            if w not in self.usage:
                raise LoadError(f"client process {w} exited with code {code} before finishing its requests")

    def _handle(self, kind: str, who: int, body: Any) -> None:
        if kind == "result":
            self.results[who] = body
            self.bar.update(1)
        elif kind == "ready":
            if not self.spawned_at <= body <= time.perf_counter():
                raise LoadError("time.perf_counter differs between processes on this system; "
                                "use --client-processes 1")
            self.ready.add(who)
        elif kind == "done":
            self.usage[who] = body
        elif kind == "error":
            raise LoadError(f"client process {who} failed: {body}")

    async def wait(self, done: Callable[[], bool], timeout_s: float | None = None, what: str = "") -> None:
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while True:
            self.poll()
            if done():
                return
            if deadline is not None and time.perf_counter() > deadline:
                raise LoadError(f"client processes {what} within {timeout_s:.0f} s")
            await asyncio.sleep(POLL_S)


async def _run_in_processes(target: CompletionTarget, requests: list[BenchRequest], plan: LoadPlan,
                            slots: list[int]) -> LoadResult:
    # spawn: the workers start from a clean interpreter, nothing inherited (no CUDA, no event loop)
    ctx = multiprocessing.get_context("spawn")
    shared = _Shared(messages=ctx.Queue(), next_position=ctx.Value("q", 0), start=ctx.Value("d", 0.0),
                     go=ctx.Event())
    processes = [
        ctx.Process(target=_worker_main, name=f"bench-client-{w}", daemon=True,
                    args=(_Job(w, n, target, requests, plan.arrivals, plan.request_timeout_s), shared))
        for w, n in enumerate(slots)
    ]
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=None if plan.progress else True)
    collector = _Collector(shared, processes, [None] * len(requests), bar, spawned_at=time.perf_counter())
    try:
        _start_with_sigint_blocked(processes)
        await collector.wait(lambda: len(collector.ready) == len(processes), STARTUP_TIMEOUT_S, "did not start")
        start = time.perf_counter() + START_MARGIN_S
        shared.start.value = start
        shared.go.set()
        await collector.wait(lambda: len(collector.usage) == len(processes))
        for p in processes:
            p.join(timeout=5.0)  # each has sent everything and is exiting
    finally:
        bar.close()
        _stop(processes)
    missing = sum(r is None for r in collector.results)
    if missing:
        raise LoadError(f"{missing} results did not come back from the client processes")
    usage = [collector.usage[w] for w in range(len(processes))]
    return LoadResult(results=collector.results, duration_s=max(u.span_s for u in usage), usage=usage,
                      clock_start=start)


def _start_with_sigint_blocked(processes: list[BaseProcess]) -> None:
    """Start the processes with SIGINT blocked in this thread: they inherit the blocked signal
    across fork and exec, so that a Ctrl-C while one still imports prints no traceback of its own
    (_worker_main ignores it, then unblocks it).

    Blocked, not ignored: a SIGINT ignored here would be lost, and the run would go on to its end
    and exit 0 as if no Ctrl-C had come. A blocked one stays pending and is handled as soon as the
    mask is restored (or at once by another thread of this process that does not block it): asyncio's
    handler cancels the run, and the processes are stopped. pthread_sigmask, unlike
    signal.signal, works in any thread. The resource tracker, which unblocks SIGINT after starting
    itself, is already running: the shared queue and values registered their semaphores with it."""
    if not hasattr(signal, "pthread_sigmask"):  # not on POSIX: no process groups to fear either
        for p in processes:
            p.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for p in processes:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stop(processes: list[BaseProcess]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        if p.pid is None:  # never started
            continue
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()


async def probe(target: CompletionTarget, request: BenchRequest, timeout_s: float = 600.0) -> RequestResult:
    """One short request before the run: it fails fast on a wrong URL or model name and keeps
    first-request warm-up out of the figures."""
    async with _session(1, timeout_s) as session:
        return await stream_completion(session, target, request, time.perf_counter(),
                                       max_tokens=min(2, request.output_len))


async def discover_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str | None:
    async with _session(1, timeout_s) as session:
        models = await list_models(session, base_url, api_key)
    return models[0] if models else None


# --- multi-turn conversations -------------------------------------------------------------------

FILLER_TOKEN = 0  # stands for a reply's tokens when the server does not send their ids


async def run_conversations(target: CompletionTarget, conversations: list[Conversation], concurrency: int | None = None,
                            progress: bool = True, request_timeout_s: float = 6 * 3600.0) -> LoadResult:
    """Every conversation at once, each turn after the previous one's reply (its prompt is the
    conversation so far: the previous prompt, the reply's token ids, then the turn's new tokens);
    at most `concurrency` requests in flight. A failed turn ends its conversation: the turns after
    it count as failed. Results in (conversation, turn) order. One client process."""
    total = sum(c.num_turns for c in conversations)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=total, desc="turns", unit="req", disable=None if progress else True)
    async with _session(concurrency or max(1, len(conversations)), request_timeout_s) as session:
        start = time.perf_counter()
        cpu_start = time.process_time()

        async def talk(conv: Conversation) -> list[RequestResult]:
            history: list[int] = []
            results: list[RequestResult] = []
            for turn in range(conv.num_turns):
                request = conv.request(turn, history)
                if results and not results[-1].success:
                    result = RequestResult(index=request.index, prompt_len=request.num_prompt_tokens,
                                           error="an earlier turn of the conversation failed")
                else:
                    if slots is not None:
                        await slots.acquire()
                    try:
                        result = await stream_completion(session, target, request, start, keep_ids=True)
                    finally:
                        if slots is not None:
                            slots.release()
                    reply = result.output_ids if result.output_ids else [FILLER_TOKEN] * result.output_tokens
                    assert not isinstance(request.prompt, str)
                    history = request.prompt + reply
                result.turn, result.conversation = turn, conv.index
                result.output_ids = None  # the history has them; results stay small
                results.append(result)
                bar.update(1)
            return results

        per_conv = await asyncio.gather(*(talk(c) for c in conversations))
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    bar.close()
    return LoadResult(results=[r for rs in per_conv for r in rs], duration_s=duration,
                      usage=[ProcessUsage(cpu, duration)], clock_start=start)
