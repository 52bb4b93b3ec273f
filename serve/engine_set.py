"""A set of engines, each in a child process of its own (scheduler/engine_proc.py), behind one
server: what data-parallel replicas (serve/replicas.py) and prefill/decode disaggregation
(serve/disagg.py) share of placing them on the GPUs or CPU cores, starting them and holding the
started ones. How the set serves requests is each of those modules' own.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from engine.config import EngineConfig, ModelConfig
from scheduler.engine_proc import EngineStartError, ProcessCore
from serve.build import load_tokenizer
from serve.engine_process import EngineInfo

# -- placement -----------------------------------------------------------------------------------


class Place(Protocol):
    """Where one engine of a set runs."""

    @property
    def name(self) -> str: ...  # "replica 0", "prefill 0": its log lines' label and its part of describe()
    @property
    def gpus(self) -> tuple[str, ...]: ...  # CUDA device ids it sees (as CUDA_VISIBLE_DEVICES), empty on the CPU
    @property
    def cpu_threads(self) -> int | None: ...  # on the CPU: its share of the cores (OMP_NUM_THREADS)
    def describe(self) -> str: ...


def visible_gpus(environ: Mapping[str, str], dev: Path = Path("/dev")) -> list[str]:
    """The CUDA device ids this process may use, without initializing CUDA (the server process never
    imports torch): CUDA_VISIBLE_DEVICES when set, else one per /dev/nvidiaN device node."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    try:
        nodes = [p.name for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name)]
    except OSError:
        nodes = []
    return [str(i) for i in range(len(nodes))]


def gpus_per_engine(cfg: EngineConfig) -> int:
    """The GPUs (or, on the CPU, processes) one engine takes."""
    return cfg.tensor_parallel_size * cfg.pipeline_parallel_size


def runs_on_cpu(cfg: EngineConfig, gpus: list[str]) -> bool:
    return cfg.device == "cpu" or (cfg.device == "auto" and not gpus)


def cpu_threads(cpu_count: int, num_processes: int) -> int:
    """On the CPU, each model-stepping process's share of the cores: one core is left for the server."""
    return max(1, (cpu_count - 1) // num_processes)


def enter_place(place: Place) -> None:
    """In the engine's child process, before torch is imported there: the environment decides which
    GPUs torch (and the parallel ranks this process starts) will see; log lines name the engine."""
    if place.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(place.gpus)
    if place.cpu_threads is not None and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(place.cpu_threads)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(name)s[{place.name}]: %(message)s"))


# -- start-up ----------------------------------------------------------------------------------

def start_engines(cores: list[ProcessCore], names: list[str], model_path: Path) -> tuple[Any, list[EngineInfo]]:
    """Spawn every engine at once, load the tokenizer meanwhile, then wait until each has built its
    engine: (tokenizer, the engines' infos). A failed build raises EngineStartError prefixed with
    the engine's name; on any failure every engine is stopped."""
    try:
        for core in cores:
            core.spawn()
        tokenizer = load_tokenizer(model_path)
        infos = []
        for name, core in zip(names, cores):
            try:
                infos.append(core.wait_ready())
            except EngineStartError as e:
                raise EngineStartError(f"{name}: {e}") from None
    except BaseException:
        for core in cores:
            core.kill()
        raise
    return tokenizer, infos


P = TypeVar("P", bound=Place)


@dataclass
class EngineSet(Generic[P]):
    """The started engines; quacks like serve.engine_process.ProcessEngine for serve/run_cmd.py and
    serve/api.py."""

    cores: list[ProcessCore]
    infos: list[EngineInfo]
    places: list[P]
    tokenizer: Any
    model_config: ModelConfig
    config: EngineConfig

    @property
    def model_name(self) -> str:
        return self.infos[0].model_name

    @property
    def max_model_len(self) -> int:
        return min(info.max_model_len for info in self.infos)

    @property
    def num_kv_blocks(self) -> int:
        """The KV blocks the set counts as its capacity: every engine's."""
        return sum(info.num_blocks for info in self.infos)

    @property
    def runner(self) -> EngineInfo:
        """The engines as one (for the banner and /metrics): num_kv_blocks, the shortest context."""
        first = self.infos[0]
        return EngineInfo(first.model_name, self.max_model_len, self.num_kv_blocks, first.device, first.dtype_name)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def describe(self) -> str:
        return "; ".join(f"{p.name}: {p.describe()}, {info.num_blocks} KV blocks"
                         for p, info in zip(self.places, self.infos))

    def shutdown(self) -> None:
        """Stop the children no serving set stopped (start-up failed, or the server never ran)."""
        for core in self.cores:
            core.kill()
