"""The engine in a child process (`serve run --engine-loop process`): what the server process keeps.

The server process reads config.json and loads the tokenizer (while the child builds the engine);
the child builds everything else, is the only process that touches the device, and reports the
figures the server prints and serves. See scheduler/engine_proc.py for the loop and the wire.
"""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, ModelConfig
from scheduler.core import EngineCore
from scheduler.engine_proc import ProcessCore
from serve.build import load_tokenizer, model_folder_config

log = logging.getLogger("pagedserve")


@dataclass(frozen=True)
class EngineInfo:
    """What the child reports once the engine is built. The field names are ModelRunner's, so the
    server's banner reads them the same way in both modes."""

    model_name: str
    max_model_len: int  # may be lower than asked for: the KV cache's capacity
    num_blocks: int
    device: str
    dtype_name: str
    num_scheduler_steps: int = 1  # decode steps per scheduling round: > 1 for a host-bound (small) model


def build_core(cfg: EngineConfig, show_progress: bool,
               core_class: type[EngineCore] = EngineCore) -> tuple[EngineCore, EngineInfo]:
    """Runs in the child."""
    import threading

    import torch
    from tqdm import tqdm

    from serve.build import build_engine

    log.debug("start-up: engine imports done")
    # The child's progress bars need no lock shared with other processes. tqdm's default one is a
    # multiprocessing semaphore, which the resource tracker reported as leaked ("UserWarning:
    # resource_tracker: There appear to be 1 leaked semaphore objects") when a Ctrl-C ended the
    # child during its build (scheduler/engine_proc.py: child_main).
    tqdm.set_lock(threading.RLock())

    engine = build_engine(cfg, show_progress, core_class)
    watch = getattr(engine.core.executor, "watch_workers", None)
    if watch is not None:
        # a tensor-parallel rank that dies while this process waits for requests (or, on a GPU, inside
        # a collective that never returns) ends it: the server then fails its requests
        watch(_exit_lost)
    if engine.runner.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Leave the server process a core: OpenMP threads spin-wait for each other, and a step of
        # small ops slows down many times over when one of them loses its core (measured: 10x).
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    elif engine.runner.device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        # A GPU step's host-side tensors are small: OpenMP threads would only spin (measured:
        # 14.7 cores busy under serve bench), taking the cores of the server and tokenizer.
        torch.set_num_threads(1)
    return engine.core, EngineInfo(engine.model_name, engine.max_model_len, engine.runner.num_blocks,
                                   str(engine.runner.device), engine.runner.dtype_name,
                                   engine.runner.num_scheduler_steps)


def _exit_lost(why: str) -> None:
    import logging

    from scheduler.engine_proc import EXIT_LOST

    logging.getLogger("pagedserve").error("the engine stops: %s", why)
    os._exit(EXIT_LOST)


@dataclass
class ProcessEngine:
    """Quacks like serve.build.Engine for serve/api.py and serve/run_cmd.py; `core` is the
    ProcessCore that AsyncEngine drives instead of an EngineCore."""

    core: ProcessCore
    tokenizer: Any
    model_config: ModelConfig
    config: EngineConfig
    runner: EngineInfo
    seq_ids: Iterator[int] | None = None  # this API process's sequence ids (serve/api_processes.py)
    api_process: int | None = None  # its index among several (0: the server process)

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def shutdown(self) -> None:
        """Stop the child if no AsyncEngine did (startup failed, or the server never ran)."""
        self.core.kill()


def start_engine_process(cfg: EngineConfig, show_progress: bool = True,
                         meanwhile: Callable[[], None] = lambda: None, api_processes: int = 1) -> ProcessEngine:
    """Start the engine process and wait until it has built the engine, running meanwhile() (and
    loading the tokenizer) in this process while it builds. A bad model folder fails here before
    any process starts; a failed build raises EngineStartError (a RuntimeError). api_processes > 1:
    the engine process also gets channels for the other API processes (core.channels), and this
    process's sequence ids are every api_processes-th."""
    path, model_cfg = model_folder_config(cfg, show_progress)
    core = ProcessCore(build_core, (cfg, show_progress))
    try:
        core.spawn(api_channels=api_processes - 1)
        tokenizer = load_tokenizer(path)
        log.debug("start-up: the server's tokenizer loaded")
        meanwhile()
        info = core.wait_ready()
    except BaseException:
        core.kill()
        raise
    if api_processes == 1:
        return ProcessEngine(core, tokenizer, model_cfg, cfg, info)
    return ProcessEngine(core, tokenizer, model_cfg, cfg, info, itertools.count(0, api_processes), 0)
