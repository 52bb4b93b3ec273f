"""Rank 0's side of tensor (and pipeline) parallelism: start the other ranks, and the executor that
sends each step to them before rank 0's own runner runs it (engine/parallel/pipeline.py's executor
for several stages).

start_tensor_parallel() spawns ranks 1..N-1 (multiprocessing, spawn) with the standard environment
variables pointing at rank 0's rendezvous store, waits until each has arrived (watching the
processes, so one that dies early can't hang it), joins the group, and builds rank 0's runner while
the others build theirs. Under torchrun (WORLD_SIZE set) it spawns nothing: the launcher started the
other ranks, which run serve/build.py's follower entry.

A rank that dies, or a step that fails on rank 0 (the ranks are then out of step), loses the
executor for good: ExecutorLost, which fails every request (scheduler/core.py)."""
from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.grammar_mask import build_grammar_masks
from engine.parallel.comm import Comm
from engine.parallel.group import TPGroup, destroy_group, host_store, launched_externally, rank_env
from engine.parallel.topology import Topology, join, rank_role, world_size
from engine.parallel.wire import BatchEncoder
from engine.parallel.worker import cpu_threads, worker_main
from engine.runner import Launched, ModelRunner, resolve_device
from scheduler.request import Batch, ExecutorLost, SampleOutput, describe_exit

log = logging.getLogger("pagedserve")
STOP_TIMEOUT_S = 10.0


@dataclass
class Worker:
    rank: int
    proc: BaseProcess
    conn: Connection  # rank 0's end: the rank reports a failure here; its EOF ends the rank
    role: str = ""  # how messages name it: "tensor-parallel rank 1"

    def __post_init__(self) -> None:
        self.role = self.role or f"tensor-parallel rank {self.rank}"

    def error(self) -> str | None:
        """What the rank reported before it exited, if anything."""
        error = None
        try:
            while self.conn.poll():
                kind, message = self.conn.recv()
                error = message if kind == "error" else error
        except (EOFError, OSError, ValueError):
            pass
        return error


class Workers:
    """The processes of ranks 1..N-1 that rank 0 spawned."""

    def __init__(self, workers: list[Worker]) -> None:
        self.list = workers

    def dead(self, wait_s: float = 0.0) -> str | None:
        """A sentence about the first rank that has exited (waiting up to wait_s for one), or None."""
        ready = wait([w.proc.sentinel for w in self.list], wait_s)
        for w in self.list:
            if w.proc.sentinel in ready:
                w.proc.join(5.0)  # its end of the sentinel closes a moment before it can be reaped
            if w.proc.exitcode is not None:
                why = w.error()
                return (f"{w.role} exited ({describe_exit(w.proc.exitcode)})"
                        + (f": {why}" if why else ""))
        return None

    def join_or_kill(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self.list:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                log.warning("%s did not stop within %.0f s; killing it", w.role, timeout_s)
                w.proc.kill()
                w.proc.join(5.0)
        for w in self.list:
            w.conn.close()


@dataclass
class TPLaunched:
    step: int
    inner: Launched


class TPExecutor:
    """The scheduler's executor on rank 0 (launch/collect/execute like ModelRunner's): each step
    goes to the other ranks first (one broadcast), then to rank 0's runner. `runner` is rank 0's
    ModelRunner, for what the rest of the engine reads from it (blocks, device, budgets)."""

    def __init__(self, runner: ModelRunner, group: TPGroup, workers: Workers | None) -> None:
        self.runner = runner
        self.group = group
        self.comm = Comm(group)
        self.workers = workers
        self.overlap = runner.overlap
        self.lost: str | None = None
        self._encoder = BatchEncoder()
        self._steps = itertools.count()
        self._closing = False
        atexit.register(self.close)

    # -- the executor protocol -------------------------------------------------------------

    def launch(self, batch: Batch, prev: TPLaunched | None = None) -> TPLaunched:
        step = next(self._steps)
        self._send(("launch", step, None if prev is None else prev.step, self._encoder.encode(batch), False))
        return TPLaunched(step, self._run(self.runner.launch, batch, None if prev is None else prev.inner))

    def collect(self, handle: TPLaunched) -> list[SampleOutput | None]:
        self.finish(handle)
        return self._run(self.runner.collect, handle.inner)

    def finish(self, handle: TPLaunched) -> None:
        """runner.finish() on every rank: a step whose constrained rows' sampling waited for the
        tokens before them; the other ranks get those tokens first (their masks are their own)."""
        deferred = handle.inner.deferred
        if deferred is None:
            return
        self._send(("finish", handle.step, self._encoder.tokens([it.seq for it in deferred.items])))
        self._run(self.runner.finish, handle.inner)

    def enable_grammar(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        """Constrained decoding on every rank that samples (engine/grammar_mask.py): each builds its
        own masks from the same tokens, so every rank draws the same token. Nothing where the
        tokenizer can't drive a grammar."""
        self.runner.grammar = build_grammar_masks(tokenizer, vocab_size, eos_token_ids, self.runner.device)
        if self.runner.grammar is not None:
            self._send(("grammar", tokenizer, vocab_size, eos_token_ids))

    @property
    def lora_slots(self) -> int:
        return self.runner.lora_slots

    def load_lora(self, slot: int, lora_id: int, name: str, path: str) -> None:
        """ModelRunner.load_lora on every rank: rank 0 first, so that an adapter that does not fit
        fails here (LoraError) before the others read it."""
        self.runner.load_lora(slot, lora_id, name, path)
        self._send(("lora", slot, lora_id, name, path))

    def execute(self, batch: Batch) -> list[SampleOutput | None]:
        self._send(("launch", next(self._steps), None, self._encoder.encode(batch), True))
        return self._run(self.runner.execute, batch)

    def enable_step_timing(self) -> None:
        self.runner.enable_step_timing()

    def gpu_times(self, handle: TPLaunched) -> tuple[float, float] | None:
        return self.runner.gpu_times(handle.inner)

    # -- lifecycle -----------------------------------------------------------------------------

    def watch_workers(self, on_death: Callable[[str], None], grace_s: float = 5.0) -> None:
        """Call on_death(why) from a thread grace_s after a rank dies, unless closing by then: for a
        process that must not outlive its ranks even while it waits for something else (an idle
        engine process; a collective that never returns on a GPU)."""
        if self.workers is None:
            return

        def watch() -> None:
            wait([w.proc.sentinel for w in self.workers.list])
            if self._closing:
                return
            time.sleep(grace_s)
            if not self._closing:
                on_death(self.workers.dead() or "a tensor-parallel rank exited")

        threading.Thread(target=watch, name="tp-watch", daemon=True).start()

    def close(self) -> None:
        """Stop the other ranks (they finish the step they run) and leave the group."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        # under torchrun (no workers of ours) the ranks are told too: they exit once told
        if self.group.size > 1 and self.lost is None and (self.workers is None or self.workers.dead() is None):
            try:
                self._stop_ranks()
            except Exception:
                log.warning("could not tell the tensor-parallel ranks to stop; killing them")
        # leave the group before waiting for the ranks, which leave it as they stop: NCCL's teardown
        # may wait for every rank (on two GPUs, rank 0 joining first made stopping take > 10 s)
        told = time.monotonic()
        if self.lost is None:  # a lost rank may leave a collective spinning on this GPU: no sync then
            self.runner.release_graphs()
        destroy_group(self.group)
        left = time.monotonic()
        if self.workers is not None:
            self.workers.join_or_kill(STOP_TIMEOUT_S if self.lost is None else 0.5)
        log.info("ranks stopped: rank 0 left the group in %.2f s, the others exited %.2f s later",
                 left - told, time.monotonic() - left)

    # -- internals ---------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        if self.lost is not None:
            raise ExecutorLost(self.lost)
        why = self.workers.dead() if self.workers is not None else None
        if why is not None:
            raise self._lose(why)
        try:
            self._post(msg)
        except Exception as e:
            raise self._lose(None, e) from e

    def _post(self, msg: tuple) -> None:
        """msg to every other rank (worker.py's follow() reads it)."""
        self.comm.broadcast_object(msg)

    def _stop_ranks(self) -> None:
        self._post(("stop",))

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            raise self._lose(None, e) from e

    def _lose(self, why: str | None, error: Exception | None = None) -> ExecutorLost:
        if why is None and self.workers is not None:
            why = self.workers.dead(wait_s=2.0)  # a collective that failed: most likely a rank died
        if why is None:
            why = (f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {error}); "
                   "the ranks can't go on in step")
        self.lost = why
        log.error("%s", self.lost)
        return ExecutorLost(self.lost)


def check_devices(cfg: EngineConfig, device_type: str) -> None:
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    n = world_size(tp, pp)
    if device_type == "cuda" and n > torch.cuda.device_count():
        what = f"tensor_parallel_size {tp}" if pp == 1 else f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
        raise ValueError(f"{what} needs {n} GPUs; {torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)")


def start_tensor_parallel(model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig, max_model_len: int,
                          show_progress: bool = True, draft: tuple[ModelConfig, Path | None] | None = None) -> TPExecutor:
    """Rank 0: the other ranks started (or, under torchrun, joined), the groups made, rank 0's runner
    built -> the executor (a PipelineExecutor with several stages). Raises ValueError/RuntimeError
    with a one-line reason when a rank fails. draft: a draft model's config and folder (rank 0's)."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    size = world_size(tp, pp)
    device_type = resolve_device(cfg.device).type
    check_devices(cfg, device_type)
    if launched_externally(os.environ):
        if int(os.environ["WORLD_SIZE"]) != size or os.environ.get("RANK") != "0":
            raise ValueError(f"launched as rank {os.environ.get('RANK')} of {os.environ['WORLD_SIZE']}: rank 0 "
                             f"serves, and WORLD_SIZE must equal tensor_parallel_size x pipeline_parallel_size ({size})")
        topo = join(os.environ, device_type, tp, pp, model_cfg.num_layers)
        workers = None
    else:
        if device_type == "cpu":
            cpu_threads(size)
        topo, workers = _spawn_ranks(model_cfg, model_path, cfg, max_model_len, device_type)
    group = topo.world
    try:
        runner = ModelRunner(model_cfg, model_path, cfg, max_model_len, show_progress, tp=topo.tp, pp=topo.pipe,
                             draft=draft)
    except BaseException as e:
        why = workers.dead(wait_s=2.0) if workers is not None else None
        if workers is not None:
            for w in workers.list:
                w.proc.kill()
            workers.join_or_kill(5.0)
        destroy_group(group)
        if why is not None:
            raise RuntimeError(f"{why} while the engine started") from e
        raise
    if topo.pipe is not None:
        from engine.parallel.pipeline import PipelineExecutor  # it builds on TPExecutor

        return PipelineExecutor(runner, topo, workers)
    return TPExecutor(runner, group, workers)


def _spawn_ranks(model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig, max_model_len: int,
                 device_type: str) -> tuple[Topology, Workers]:
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    size = world_size(tp, pp)
    store = host_store(size)
    ctx = mp.get_context("spawn")
    workers: list[Worker] = []
    # the ranks start with SIGINT ignored: a Ctrl-C is rank 0's to handle (it stops them in order)
    swap = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if swap else None
    try:
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"pagedserve-rank{rank}", daemon=True, args=(
                rank_env("127.0.0.1", store.port, rank, size), model_cfg, model_path, cfg, max_model_len, theirs,
                logging.getLogger().getEffectiveLevel()))
            proc.start()
            theirs.close()
            workers.append(Worker(rank, proc, ours, rank_role(rank, tp, pp)))
    finally:
        if swap:
            signal.signal(signal.SIGINT, previous)
    ranks = Workers(workers)
    try:
        waiting = {w.conn: w for w in workers}
        while waiting:  # each rank says it arrived, or exits (its sentinel) first
            for ready in wait(list(waiting) + [w.proc.sentinel for w in waiting.values()]):
                w = waiting.pop(ready, None)
                if w is None or w.conn.recv()[0] != "arrived":
                    raise RuntimeError(f"{ranks.dead(wait_s=5.0) or 'a tensor-parallel rank failed'} while the engine started")
        topo = join(rank_env("127.0.0.1", store.port, 0, size), device_type, tp, pp, model_cfg.num_layers, store=store)
    except BaseException:
        for w in workers:
            w.proc.kill()
        ranks.join_or_kill(5.0)
        raise
    return topo, ranks
