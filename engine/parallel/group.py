"""The tensor-parallel process group, made from the standard environment variables (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), so the same code runs under torchrun and under
pagedserve's own launcher (engine/parallel/executor.py), which sets them for the ranks it spawns.

Two groups: `device` for the model's tensors (NCCL on GPUs, gloo on the CPU) and `control`, a gloo
group on the CPU for what rank 0 sends the others (each step, agreed sizes, stop)."""
from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("pagedserve")
ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
# a peer that stops answering makes a collective raise after this long instead of hanging; model
# steps and start-up phases (weights, graph capture) of the other ranks must fit in it
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TPGroup:
    """One rank's place in the tensor-parallel group. size 1: no process group at all."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: Any = None  # the torch.distributed group for tensors (None when size is 1)
    control: Any = None  # the gloo group for control messages (None when size is 1)

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules; the others follow."""
        return self.rank == 0


SINGLE = TPGroup()


def launched_externally(env: Mapping[str, str]) -> bool:
    """True when a launcher such as torchrun started this process as one rank of several."""
    return int(env.get("WORLD_SIZE", "1") or 1) > 1


def rank_env(addr: str, port: int, rank: int, size: int) -> dict[str, str]:
    """The variables a spawned rank starts with (one host: LOCAL_RANK is the rank)."""
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(rank)}


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def host_store(size: int, addr: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port the OS picks (store.port): no fixed port to collide on."""
    return dist.TCPStore(addr, 0, size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_group(env: Mapping[str, str], device_type: str, store: dist.Store | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the group that env describes (the ENV_VARS). store: where pagedserve spawned the ranks,
    rank 0's host_store (connect_store on the others); None: env:// from this process's environment
    (torchrun). On a GPU the rank's device becomes cuda:LOCAL_RANK."""
    missing = [k for k in ENV_VARS if k != "LOCAL_RANK" and k not in env]
    if missing:
        raise ValueError(f"tensor parallelism needs the environment variables {', '.join(missing)} "
                         "(torchrun sets them)")
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", rank))
    if size == 1:
        return SINGLE
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine already runs in this process; shut it down first")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", local_rank)} if device_type == "cuda" else {}
    # without a store: env:// (MASTER_ADDR/MASTER_PORT of this process; under torchrun its agent's store)
    kwargs.update({"store": store} if store is not None else {"init_method": "env://"})
    dist.init_process_group(backend_for(device_type), rank=rank, world_size=size, timeout=timeout, **kwargs)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, local_rank, dist.group.WORLD, control)


def connect_store(env: Mapping[str, str], timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A spawned rank's client of rank 0's host_store (init_group's store: both sides then use it
    as it is, while env:// would add a prefix of its own to the keys)."""
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def destroy_group(group: TPGroup, timeout_s: float = 10.0) -> bool:
    """Leave the process group; True once left. NCCL's teardown hangs while CUDA graphs that
    captured its collectives live (pytorch/pytorch#115388; both ranks of a TP=2 engine on H100s,
    2026-11-26): the runners free theirs first (ModelRunner.release_graphs), and with NCCL the
    teardown runs on a daemon thread that, past timeout_s, is left there: the caller goes on."""
    if group.size == 1 or not dist.is_initialized():
        return True
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return True
    teardown = threading.Thread(target=dist.destroy_process_group, name="nccl-teardown", daemon=True)
    teardown.start()
    teardown.join(timeout_s)
    if teardown.is_alive():
        log.warning("the NCCL process group did not close within %.0f s; going on without it", timeout_s)
        return False
    return True


