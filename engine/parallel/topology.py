"""The ranks of a tensor x pipeline parallel engine and their process groups.

Ranks are laid out pipeline-major: rank = stage * tp + tp_rank. Every rank is in the world group
(init_group: the device backend for tensors, a gloo group for control); with several stages each
stage's ranks also form a tensor-parallel sub-group (device and gloo), and a rank's carry (hidden
state and residual) goes to the rank of equal tp_rank in the next stage by send/recv on the world
group (NCCL on GPUs, gloo on the CPU). With one stage the world is the tensor-parallel group, as
before pipeline parallelism existed."""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.comm import Comm
from engine.parallel.group import DEFAULT_TIMEOUT_S, TPGroup, backend_for, init_group
from engine.parallel.stage import Stage, stage_of


def world_size(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    return tensor_parallel_size * pipeline_parallel_size


def rank_role(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """How errors name a rank: "tensor-parallel rank 1", or with stages "pipeline-parallel rank 3
    (stage 1, tensor-parallel rank 1)"."""
    if pipeline_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    stage, tp_rank = divmod(rank, tensor_parallel_size)
    return f"pipeline-parallel rank {rank} (stage {stage}" + (f", tensor-parallel rank {tp_rank})"
                                                              if tensor_parallel_size > 1 else ")")


@dataclass(frozen=True)
class Pipe:
    """One rank's place in the pipeline: its stage and the ranks its carry comes from and goes to."""

    stage: Stage
    world: TPGroup
    prev: int | None  # global rank of the previous stage's rank of equal tp_rank; None on the first stage
    next: int | None  # ... of the next stage; None on the last

    @property
    def comm(self) -> Comm:
        """The world's control collectives (sizes every rank must agree on, e.g. KV blocks)."""
        return Comm(self.world)

    def recv_carry(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's carry [2, num_tokens, hidden] (on a GPU the stream waits; the host does not)."""
        carry = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.irecv(carry, src=self.prev, group=self.world.device).wait()
        return carry

    def send_carry(self, carry: torch.Tensor) -> "Sent":
        carry = carry.contiguous()
        return Sent(dist.isend(carry, dst=self.next, group=self.world.device), carry)


@dataclass
class Sent:
    """A send in flight: its tensor stays referenced until wait() (gloo reads it while sending)."""

    work: Any
    tensor: torch.Tensor | None

    def wait(self) -> None:
        if self.tensor is not None:
            self.work.wait()
            self.tensor = None


@dataclass(frozen=True)
class Topology:
    world: TPGroup  # every rank
    tp: TPGroup  # this rank's tensor-parallel group (its stage's ranks)
    pipe: Pipe | None  # None with one stage

    @property
    def is_driver(self) -> bool:
        return self.world.rank == 0


def join(env: Mapping[str, str], device_type: str, tensor_parallel_size: int, pipeline_parallel_size: int,
         num_layers: int, store: dist.Store | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Topology:
    """Join the world that env describes (init_group) and make the stages' groups."""
    world = init_group(env, device_type, store=store, timeout_s=timeout_s)
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    assert world.size == tp * pp, f"{world.size} ranks for tensor x pipeline parallel {tp} x {pp}"
    if pp == 1:
        return Topology(world, world, None)
    stage, tp_rank = divmod(world.rank, tp)
    group = TPGroup(0, 1, world.local_rank)
    if tp > 1:
        timeout = datetime.timedelta(seconds=timeout_s)
        for s in range(pp):  # every rank makes every stage's groups, in the same order
            ranks = list(range(s * tp, (s + 1) * tp))
            device = dist.new_group(ranks, timeout=timeout, backend=backend_for(device_type))
            control = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if s == stage:
                group = TPGroup(tp_rank, tp, world.local_rank, device, control)
    pipe = Pipe(stage_of(num_layers, stage, pp), world, world.rank - tp if stage > 0 else None,
                world.rank + tp if stage < pp - 1 else None)
    return Topology(world, group, pipe)
