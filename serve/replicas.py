"""Data-parallel replicas (`serve run --data-parallel-size N`): N engines, each in a child process
of its own (scheduler/engine_proc.py), behind the one HTTP server.

Replica i runs on GPUs i*g .. i*g+g-1 of those visible (g: the GPUs one engine takes, its
tensor- times pipeline-parallel size), which its process sees as its only ones (CUDA_VISIBLE_DEVICES); on the CPU
the replicas share the cores. ReplicaSet stands where a single AsyncEngine stands in the server: it
admits a request (the same queue limit and rate limit over all replicas), asks serve/router.py
which replica serves it, and hands it to that replica's AsyncEngine, whose stream then carries
the request's outputs, aborts and disconnects to that replica alone.

A replica that dies fails its own requests only (with the reason); the router sends it nothing
more, /health says "degraded" (HTTP 200: the server still serves) and /metrics' replica_up drops
to 0. When the last replica dies the server stops and exits non-zero, as a single engine's does.
A failed replica is not restarted: restart the server (on "degraded", if wanted) to get it back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence as Seq
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from engine.config import EngineConfig
from scheduler.core import EngineCore
from scheduler.engine_proc import ProcessCore
from scheduler.loop import (Admission, AsyncEngine, EngineSnapshot, EngineUnavailable, Front, LoopConfig,
                            RequestRecord, RequestStream, unavailable)
from scheduler.request import SamplingParams
from serve.build import model_folder_config
from serve.engine_process import EngineInfo, build_core
from serve.engine_set import (EngineSet, cpu_threads, enter_place, gpus_per_engine, runs_on_cpu, start_engines,
                              visible_gpus)
from serve.router import Load, NoReplica, Router, RouterConfig

log = logging.getLogger("pagedserve")
T = TypeVar("T")


# -- placement -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where replica `index` runs."""

    index: int
    gpus: tuple[str, ...]  # CUDA device ids it sees (as CUDA_VISIBLE_DEVICES), empty on the CPU
    cpu_threads: int | None  # on the CPU: its share of the cores (OMP_NUM_THREADS)

    @property
    def name(self) -> str:
        return f"replica {self.index}"

    def describe(self) -> str:
        return f"GPU {', '.join(self.gpus)}" if self.gpus else f"CPU ({self.cpu_threads} threads)"


def place_replicas(cfg: EngineConfig, size: int, gpus: list[str], cpu_count: int) -> list[Placement]:
    """One Placement per replica. Raises ValueError (one line) when the GPUs do not suffice."""
    if size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1; got {size}")
    per = gpus_per_engine(cfg)
    if runs_on_cpu(cfg, gpus):
        # the cores are split among every process that steps a model
        threads = cpu_threads(cpu_count, size * per)
        return [Placement(i, (), threads) for i in range(size)]
    need = size * per
    if need > len(gpus):
        each = f" ({per} per replica)" if per > 1 else ""
        raise ValueError(f"--data-parallel-size {size} needs {need} GPUs{each}; {len(gpus)} are visible")
    return [Placement(i, tuple(gpus[i * per:(i + 1) * per]), None) for i in range(size)]


def build_replica(cfg: EngineConfig, show_progress: bool, placement: Placement) -> tuple[EngineCore, EngineInfo]:
    """Runs in replica's child process, before torch is imported there."""
    enter_place(placement)
    return build_core(cfg, show_progress)


# -- start-up ----------------------------------------------------------------------------------

@dataclass
class ReplicatedEngine(EngineSet[Placement]):
    """The started replicas (create_app builds a ReplicaSet over them); runner counts every
    replica's blocks."""

    @property
    def size(self) -> int:
        return len(self.cores)

    def loop(self, config: LoopConfig) -> "ReplicaSet":
        replica_cfg = LoopConfig(config.max_waiting_requests, None, config.max_retry_after_s)
        router = Router(RouterConfig(self.config.block_size, tuple(info.num_blocks for info in self.infos)))
        return ReplicaSet([AsyncEngine(core, replica_cfg) for core in self.cores], router, config)


def start_replicas(cfg: EngineConfig, size: int, show_progress: bool = True,
                   environ: Mapping[str, str] | None = None) -> ReplicatedEngine:
    """Start `size` engine processes and wait until every one has built its engine. Bad placement
    or a bad model folder fails before any process starts; a failed build raises EngineStartError
    naming the replica, and stops the others."""
    environ = os.environ if environ is None else environ
    placements = place_replicas(cfg, size, visible_gpus(environ), os.cpu_count() or 1)
    path, model_cfg = model_folder_config(cfg, show_progress)
    cores = [ProcessCore(build_replica, (cfg, show_progress and p.index == 0, p), name=f"pagedserve-engine-{p.index}")
             for p in placements]
    tokenizer, infos = start_engines(cores, [p.name for p in placements], path)
    return ReplicatedEngine(cores, infos, placements, tokenizer, model_cfg, cfg)


# -- serving -----------------------------------------------------------------------------------

class ReplicaObserver(Protocol):
    """serve/metrics.py's Metrics: told which replica served each finished sequence."""

    def request_finished(self, record: RequestRecord, replica: int | None = None) -> None: ...
    def request_rejected(self, reason: str) -> None: ...


class NullObserver:
    def request_finished(self, record: RequestRecord, replica: int | None = None) -> None:
        pass

    def request_rejected(self, reason: str) -> None:
        pass


class _Tap:
    """A replica's AsyncEngine observer: the set's bookkeeping, then the set's observer."""

    def __init__(self, owner: "ReplicaSet", index: int) -> None:
        self.owner = owner
        self.index = index

    def request_finished(self, record: RequestRecord) -> None:
        self.owner._finished(self.index, record)

    def request_rejected(self, reason: str) -> None:
        self.owner.observer.request_rejected(reason)


def total_snapshot(snapshots: Seq[EngineSnapshot]) -> EngineSnapshot:
    """The replicas' snapshots as one: counts summed, flags or-ed, a counter None where none has it."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(EngineSnapshot):
        vs = [getattr(s, f.name) for s in snapshots]
        if all(isinstance(v, bool) for v in vs):
            values[f.name] = any(vs)
        elif all(v is None for v in vs):
            values[f.name] = None
        else:
            values[f.name] = sum(v for v in vs if v is not None)
    return EngineSnapshot(**values)


def idle_snapshot(s: EngineSnapshot) -> EngineSnapshot:
    """A failed replica's last snapshot: its counters stay (they must not go back), its gauges are 0."""
    return dataclasses.replace(s, num_running=0, num_waiting=0, num_free_blocks=s.num_blocks, has_unfinished=False)


def route_live(router: Router, engines: Seq[AsyncEngine], prompt_tokens: Seq[int], prompt: list[int],
               failure: str | None, lora: str | None = None) -> int:
    """The router's choice for prompt (on the LoRA adapter named `lora`: its own prefix chains) among
    the engines that accept requests, by their sequences and prompt tokens in flight. Raises
    EngineUnavailable (failure, if set) when none is left."""
    loads = [Load(e.num_in_flight, prompt_tokens[i]) if e.accepting else None for i, e in enumerate(engines)]
    try:
        return router.route(prompt, loads, None if lora is None else hash(("lora", lora))).replica
    except NoReplica as e:
        raise EngineUnavailable(failure or str(e)) from None


async def add_routed(router: Router, engines: Seq[AsyncEngine], prompt_tokens: list[int],
                     requests: Seq[tuple[list[int], SamplingParams]], failure: str | None,
                     check_accepting: Callable[[], None], keep_on_cancel: bool,
                     received: float | None = None) -> tuple[int, RequestStream]:
    """The sequences of one request added to the engine the router picks among the live ones
    (route_live, by the first prompt) -> (its index, its stream). Their prompt tokens count to it
    before the add: a sequence may finish, and be subtracted, before the add returns. An engine that
    stopped since it was picked is routed around. keep_on_cancel: a cancelled add leaves the count
    to the records the engine keeps (they subtract it as they finish); else it goes back at once."""
    tokens = sum(len(ids) for ids, _ in requests)
    while True:
        check_accepting()
        index = route_live(router, engines, prompt_tokens, requests[0][0], failure, requests[0][1].lora_name)
        prompt_tokens[index] += tokens
        try:
            return index, await engines[index].add_requests(requests, received)
        except asyncio.CancelledError:
            if not keep_on_cancel:
                prompt_tokens[index] -= tokens
            raise
        except EngineUnavailable:
            prompt_tokens[index] -= tokens
            if engines[index].accepting:
                raise
            # it died (or stopped) since it was chosen: the next round routes around it
        except BaseException:
            prompt_tokens[index] -= tokens
            raise


async def call_running(engines: Seq[AsyncEngine], fn: Callable[[EngineCore], T], failure: str | None) -> list[T]:
    """fn(core) on every running engine, in order. Raises EngineUnavailable (failure, if set) when
    none runs."""
    running = [e for e in engines if e.running]
    if not running:
        raise EngineUnavailable(failure or "the engine is not running")
    return list(await asyncio.gather(*(e.call(fn) for e in running)))


class ReplicaSet(Front):
    """Requests in, streams out, over N replicas' AsyncEngines: what serve/api.py, serve/metrics.py
    and serve/run_cmd.py use of an AsyncEngine, plus per-replica state (replicas, failures, health)."""

    def __init__(self, replicas: list[AsyncEngine], router: Router, config: LoopConfig | None = None) -> None:
        self.replicas = replicas
        self.router = router
        self.config = config or LoopConfig()
        self.observer: ReplicaObserver = NullObserver()
        self.failure: str | None = None  # set once every replica has failed
        self.on_failure: Callable[[str], None] | None = None
        self.failures: list[str | None] = [None] * len(replicas)  # why each replica failed
        self._prompt_tokens = [0] * len(replicas)  # of the sequences in flight on each
        self._accepting = False
        self._admission = Admission(self.config)  # its num_adding: sequences held by the rate limit
        for i, replica in enumerate(replicas):
            replica.observer = _Tap(self, i)
            replica.on_failure = partial(self._replica_failed, i)

    # -- the AsyncEngine surface -------------------------------------------------------------

    @property
    def snapshot(self) -> EngineSnapshot:
        return total_snapshot(self.replica_snapshots())

    @property
    def running(self) -> bool:
        return any(r.running for r in self.replicas)

    @property
    def accepting(self) -> bool:
        return self._accepting and any(r.accepting for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas) + self._admission.num_adding

    @property
    def num_loop_faults(self) -> int:
        return sum(r.num_loop_faults for r in self.replicas)

    async def start(self) -> None:
        if self.running:
            return
        await asyncio.gather(*(r.start() for r in self.replicas))
        self._accepting = True

    async def drain(self, timeout_s: float) -> None:
        self._accepting = False
        await asyncio.gather(*(r.drain(timeout_s) for r in self.replicas))

    async def stop(self) -> None:
        self._accepting = False
        await asyncio.gather(*(r.stop() for r in self.replicas))

    async def add_requests(self, requests: Seq[tuple[list[int], SamplingParams]],
                           received: float | None = None) -> RequestStream:
        """Admit the sequences of one request (all or none) to one replica: the router's choice
        for the first prompt. Raises what AsyncEngine.add_requests raises."""
        n = len(requests)
        self._check_admissible(n)
        async with self._admission.adding(n):
            pass  # the replica counts them as its own from here
        # a cancelled add: the replica aborts what it added, and its records finish through _finished
        _, stream = await add_routed(self.router, self.replicas, self._prompt_tokens, requests, self.failure,
                                     self._check_accepting, keep_on_cancel=True, received=received)
        return stream

    async def call(self, fn: Callable[[EngineCore], T]) -> list[T]:
        """fn(core) on every running replica, in replica order (inspection, tests)."""
        return await call_running(self.replicas, fn, self.failure)

    async def call_replica(self, index: int, fn: Callable[[EngineCore], T]) -> T:
        return await self.replicas[index].call(fn)

    def retry_after_s(self) -> int:
        live = [r.retry_after_s() for r in self.replicas if r.running]
        return min(live) if live else 1

    # -- per replica -------------------------------------------------------------------------

    def replica_snapshots(self) -> list[EngineSnapshot]:
        return [r.snapshot if r.running else idle_snapshot(r.snapshot) for r in self.replicas]

    def replica_up(self) -> list[bool]:
        return [r.running and self.failures[i] is None for i, r in enumerate(self.replicas)]

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for GET /health."""
        replicas = [{"replica": i, "status": "ok"} if up else
                    {"replica": i, "status": "failed" if self.failures[i] else "stopped",
                     **({"error": self.failures[i]} if self.failures[i] else {})}
                    for i, up in enumerate(self.replica_up())]
        if self.accepting:
            status = "ok" if all(self.replica_up()) else "degraded"
            return 200, {"status": status, "replicas": replicas}
        if self.failure:
            return 503, {"status": "failed", "error": self.failure, "replicas": replicas}
        return 503, {"status": "shutting down" if self.running else "stopped", "replicas": replicas}

    # -- internals ---------------------------------------------------------------------------

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise unavailable(self.failure, self.running)

    def _finished(self, index: int, record: RequestRecord) -> None:
        self._prompt_tokens[index] -= record.num_prompt_tokens
        self.observer.request_finished(record, replica=index)

    def _replica_failed(self, index: int, message: str) -> None:
        self.failures[index] = message
        self.router.remove(index)
        left = sum(self.replica_up())
        log.error("replica %d failed (%s); %d of %d replicas serve on", index, message, left, len(self.replicas))
        if left == 0 and self.failure is None:
            self.failure = f"every replica has failed; the last: {message}"
            self._accepting = False
            if self.on_failure is not None:
                self.on_failure(self.failure)
