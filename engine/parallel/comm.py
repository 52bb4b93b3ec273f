"""Comm: the collectives the model and the runner use, behind one entry point per kind. The
all-reduce picks by message size: a one-shot kernel over NVLink peer memory for decode-sized
messages (engine/parallel/peer_allreduce.py) where every rank could set it up, else NCCL; the
all-reduce that a residual add and RMSNorm follow (reduce_norm) is one fused kernel on that path.

Inside the forward only fixed-shape tensor collectives run (no host sync, nothing read back): CUDA
graphs capture them as they are. With one rank every method returns its input."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engine.parallel import peer_allreduce
from engine.parallel.group import SINGLE, TPGroup

# torch >= 2.13 names it all_gather_single (the old name warns)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    def __init__(self, group: TPGroup = SINGLE) -> None:
        self.group = group
        self.rank, self.size = group.rank, group.size
        self.peer: peer_allreduce.PeerAllReduce | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks: in place through NCCL, or in a new tensor through peer memory; use
        the tensor it returns."""
        if self.size == 1:
            return t
        if self.peer is not None and self.peer.fits(t):
            return self.peer(t)
        dist.all_reduce(t, group=self.group.device)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise largest over ranks, in place through NCCL (gloo on the CPU)."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group.device)
        return t

    def reduce_norm(self, ops, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float, order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this rank's part of a sum over the ranks (a row-parallel projection's output) ->
        (RMSNorm(sum + residual) * weight, sum + residual); without residual the sum is the new
        residual stream. ops: the model's (its rms_norm where nothing is fused). order: the normed
        output's columns in this order (one rank only: LlamaForCausalLM.fold_act_orders)."""
        if self.size > 1:
            assert order is None, "act-order columns are gathered by the norm on one rank only"
            if self.fused_sums and self.peer.fits(x, self.peer.fused_max_bytes):
                return self.peer.add_norm(x, residual, weight, eps)
            x = self.all_reduce(x)
        if residual is None:
            return ops.rms_norm(x, weight, eps, order=order), x
        return ops.rms_norm(x, weight, eps, residual, order=order)

    @property
    def fused_sums(self) -> bool:
        """reduce_norm takes the fused kernel (in CUDA graph captures: the decode steps), whose wait
        on NVLink leaves the memory idle: the gate/up matmul after it pulls its first weights into
        L2 meanwhile (kernels/gate_up.py)."""
        return self.peer is not None and self.peer.fused

    def use_peer_memory(self, device: torch.device) -> str | None:
        """Set up the one-shot all-reduce on every rank, or on none: a collective that all ranks
        call at the same point. Returns why not, or None when it is on."""
        if self.size == 1:
            return "one rank"
        why = peer_allreduce.peer_access(device, self.size, self.group.device.group_name)
        if self.min_int(int(why is None)) == 0:
            return why or "another rank can't use peer memory"
        programs = self.min_int(torch.cuda.get_device_properties(device).multi_processor_count)
        peer = None
        try:
            peer = peer_allreduce.allocate(device, self.group.device, self.size, programs)
        except Exception as e:  # noqa: BLE001 (a driver or torch that refuses it: NCCL still works)
            why = f"allocating peer memory failed: {e}"
        if self.min_int(int(peer is not None)) == 0:
            return why or "another rank could not allocate peer memory"
        try:
            peer_allreduce.rendezvous(peer)
        except Exception as e:  # noqa: BLE001
            peer, why = None, f"mapping peer memory failed: {e}"
        if self.min_int(int(peer is not None)) == 0:
            return why or "another rank could not map peer memory"
        self.peer = peer
        return None

    def fuse_norm(self, hidden: int, dtype: torch.dtype, pdl: bool) -> None:
        """Take the fused kernel for reduce_norm (after use_peer_memory succeeded on every rank; a
        collective): compiled here for rows of hidden x dtype; pdl as the model's kernels launch.
        Nothing where it has no measured size limit for this many ranks."""
        if self.peer.rows is None:
            return
        self.peer.pdl = pdl
        self.peer.warm(hidden, dtype)
        self.peer.fused = True

    def peer_limits(self) -> tuple[int, int]:
        """(the one-shot all-reduce's, the fused one's) largest message inside CUDA graphs (0: NCCL)."""
        p = self.peer
        return (0, 0) if p is None else (p.max_bytes, p.fused_max_bytes if p.fused else 0)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] from every rank -> [..., size * n], rank order along the last dimension."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t, group=self.group.device)  # rank r's t at rows r * n ..
        return out.view(self.size, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], self.size * t.shape[-1])

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t into t on every rank, in place (a draft model's tokens: engine/draft.py)."""
        if self.size > 1:
            dist.broadcast(t, group=self.group.device, group_src=0)
        return t

    # -- control (host values, over the gloo group; never inside a forward) -------------------

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (sizes the ranks must agree on, e.g. KV blocks)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group.control)
        return int(t.item())

    def max_int(self, value: int) -> int:
        """The largest of every rank's value."""
        return -self.min_int(-value)

    def barrier(self) -> None:
        """Every rank's host reaches this point before any goes on (timing that must start together)."""
        if self.size > 1:
            dist.barrier(group=self.group.control)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's obj on every rank (picklable)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        # group_src: the group's first rank, which is not global rank 0 in a later pipeline stage
        dist.broadcast_object_list(box, group=self.group.control, group_src=0)
        return box[0]


SINGLE_COMM = Comm()
