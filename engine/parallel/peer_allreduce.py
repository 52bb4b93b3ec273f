"""One-shot all-reduce over NVLink peer memory, for the small messages of decode steps, alone
(torch's kernel) or fused with the residual add and RMSNorm after it (kernels/allreduce_norm.py).

NCCL's all-reduce is built for bandwidth; a decode step's messages (rows x hidden, e.g. 64 x 4096
bf16 = 512 KiB) are latency bound, and a Llama-3-8B step makes 64 of them. Here the ranks exchange
their inputs through buffers that all ranks map (torch's symmetric memory) and signal each other,
and each sums: one kernel, no ring, no host work, and CUDA graphs capture it like any other kernel.
Multicast (multimem) operations are not used: NVLS stays off.

Which messages take this path: those captured into CUDA graphs (decode steps, the piecewise and
whole-step graphs) up to a size limit per number of ranks, measured against NCCL inside CUDA graphs
(`lab/allreduce.py`, bench/results/allreduce-*.json); larger or eager ones take NCCL.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# ranks -> the largest message (bytes) this path takes. Alone in CUDA graphs (lab/allreduce.py, 4x H100
# NV18, 2026-11-26, bench/results/allreduce-4xh100-2026-11-26.json) the one-shot kernel beat NCCL up to
# 2 MiB at 2 ranks (8.8 against 10.8 us at 8 KiB) and 1 MiB at 4 (10.7 against 16.1 us at 8 KiB). Inside
# Llama-3-8B's decode graphs at TP=2 it was slightly slower than NCCL (a step of 16 rows 4.59 against 4.56
# ms, of 64 rows 5.25 against 5.18). They stay for memory: NCCL keeps ~120 KB for each collective a CUDA
# graph captures (engine/parallel/graph_memory.py), and this path takes most of the decode graphs' out of
# it (8B TP=2: ~6,200 captures against 9,123 with NCCL alone). A world size not measured uses NCCL.
ONE_SHOT_MAX_BYTES = {2: 2 << 20, 4: 1 << 20}
# ranks -> the largest message the all-reduce fused with the residual add and RMSNorm takes
# (kernels/allreduce_norm.py). On 2x H100 (lab/allreduce.py, 2026-11-27,
# bench/results/allreduce-norm-h100-2026-11-27.json) it beat NCCL's all-reduce and the norm kernel at
# every size measured, 1 to 2,048 rows of 4,096 and 8,192 bf16 values (8.7 against 12.2 us at 64 x
# 4,096; 137 against 182 us at 2,048 x 8,192); 16 MiB holds the largest mixed steps the graphs capture
# (e.g. 1,024 x 8,192). Not measured at 4 ranks: the norm after the one-shot kernel or NCCL there.
FUSED_MAX_BYTES = {2: 16 << 20}
_ALIGN = 16  # bytes: the kernel's vector width; other sizes take NCCL


def fused_buffer_bytes(ranks: int) -> int:
    """The fused kernel's rows on each GPU of a group of `ranks` (its flags, a few KiB, aside):
    outside torch's allocator and measured into TP_COMM_BYTES (kvcache/calc.py) before it existed,
    so `serve kv-calc` adds it."""
    from kernels.allreduce_norm import row_bytes

    return row_bytes(FUSED_MAX_BYTES.get(ranks, 0), ranks)


@dataclass
class PeerAllReduce:
    """Symmetric buffers of max_bytes on every rank of a group: the one-shot sum through one, and
    the sum fused with the residual add and RMSNorm through the other (after rendezvous)."""

    buffer: torch.Tensor  # uint8 [max_bytes], mapped by every rank (symmetric memory)
    group_name: str
    max_bytes: int
    copy_out: bool  # torch has the op that copies the input in itself (one kernel instead of two)
    # uint8 [flag bytes + row bytes]: the fused kernel's flags and rows (kernels/allreduce_norm.py)
    rows: torch.Tensor | None
    fused_max_bytes: int  # 0 (and rows None): no fused kernel, a world size not measured
    rank: int
    programs: int  # the fused kernel's fixed program count (the same on every rank)
    data_ptrs: torch.Tensor | None = None  # int64 [ranks]: every rank's rows, set by rendezvous
    flag_ptrs: torch.Tensor | None = None  # int64 [ranks]: every rank's flags
    fused: bool = False  # add_norm is compiled and on (Comm.fuse_norm)
    pdl: bool = False  # it launches with programmatic dependent launch (as the model's kernels do)

    def fits(self, t: torch.Tensor, limit: int | None = None) -> bool:
        """Whether t takes the one-shot kernel (or, with limit=fused_max_bytes, the fused one).
        Inside a CUDA graph capture only: the one-shot's win was measured in graphs, while eager
        forwards with it measured 3.5x slower at 16 and 32 rows (the step cost model's forwards,
        Llama-3-8B at TP=2 on H100s, 2026-11-26; cause not found)."""
        n = t.numel() * t.element_size()
        return (t.is_cuda and n <= (self.max_bytes if limit is None else limit) and n % _ALIGN == 0
                and t.is_contiguous() and torch.cuda.is_current_stream_capturing())

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of t, in a new tensor (t is left as it was)."""
        view = self.buffer[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out = torch.empty_like(t)
        if self.copy_out:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, t, "sum", self.group_name, out)
        else:
            view.copy_(t)
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", self.group_name, out)
        return out

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(sum over ranks of x + residual) * weight, the sum + residual) in one kernel;
        for an x that fits()."""
        from kernels.allreduce_norm import allreduce_add_norm

        return allreduce_add_norm(x.view(-1, x.shape[-1]), residual, weight, eps, self.data_ptrs,
                                  self.flag_ptrs, self.rank, self.programs, self.fused_max_bytes, self.pdl)

    def warm(self, hidden: int, dtype: torch.dtype) -> None:
        """Compile add_norm's kernels for rows of this size and dtype now, outside any CUDA graph
        capture (the engine takes it only inside captures): a collective, every rank at once."""
        x = torch.zeros(2, hidden, dtype=dtype, device=self.buffer.device)
        w = torch.ones(hidden, dtype=dtype, device=x.device)
        for residual in (x, None):
            self.add_norm(x, residual, w, 1e-6)
        torch.cuda.synchronize(x.device)


def peer_access(device: torch.device, ranks: int, group_name: str | None = None) -> str | None:
    """Why this rank can't use peer memory, or None when it can."""
    if device.type != "cuda":
        return "not a GPU"
    if ranks not in ONE_SHOT_MAX_BYTES:
        return f"no measured size limit for {ranks} ranks"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has no symmetric memory"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return "this torch has no one-shot all-reduce"
    if group_name is not None and _set_up_before(group_name):
        # torch keeps what it set up by group name, and names restart with a new world group: a second
        # engine in this process (LLM, then another LLM) hung mapping the buffers (2x H100, 2026-11-26)
        return f"peer memory was set up for a group named {group_name!r} earlier in this process"
    me = device.index if device.index is not None else torch.cuda.current_device()
    for peer in range(torch.cuda.device_count()):
        if peer != me and not torch.cuda.can_device_access_peer(me, peer):
            return f"GPU {me} can't reach GPU {peer} directly"
    return None


def _set_up_before(group_name: str) -> bool:
    import torch.distributed._symmetric_memory as symm_mem

    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    return bool(enabled is not None and enabled(group_name))


def allocate(device: torch.device, group, ranks: int, programs: int, max_bytes: int | None = None,
             fused_max_bytes: int | None = None) -> PeerAllReduce:
    """This rank's buffers (local: no other rank takes part yet); max_bytes, fused_max_bytes: the
    tables' limits unless given; programs: the fused kernel's program count, at most the SMs of
    every rank's GPU."""
    import torch.distributed._symmetric_memory as symm_mem

    from kernels.allreduce_norm import flag_bytes, row_bytes

    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed before torch 2.9; later versions warn that it is
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(name)
    max_bytes = max_bytes or ONE_SHOT_MAX_BYTES[ranks]
    buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
    fused_max_bytes = FUSED_MAX_BYTES.get(ranks, 0) if fused_max_bytes is None else fused_max_bytes
    rows = None
    if fused_max_bytes:
        flags = flag_bytes(programs, ranks)
        rows = symm_mem.empty(flags + row_bytes(fused_max_bytes, ranks), dtype=torch.uint8, device=device)
        rows.zero_()  # flags, and the pushed halves' "not arrived"
        torch.cuda.synchronize(device)  # zeros before any rank can map them (rendezvous comes after)
    return PeerAllReduce(buffer, name, max_bytes, hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"),
                         rows, fused_max_bytes, group.rank(), programs)


def rendezvous(peer: PeerAllReduce) -> None:
    """Map every rank's buffers into every other: a collective, all ranks call it at the same point."""
    import torch.distributed._symmetric_memory as symm_mem

    from kernels.allreduce_norm import flag_bytes

    symm_mem.rendezvous(peer.buffer, peer.group_name)
    if peer.rows is None:
        return
    handle = symm_mem.rendezvous(peer.rows, peer.group_name)
    base = peer.rows.data_ptr() - handle.buffer_ptrs[handle.rank]  # where the tensor starts in its allocation
    flag_ptrs = torch.tensor([p + base for p in handle.buffer_ptrs], dtype=torch.int64, device=peer.rows.device)
    peer.flag_ptrs = flag_ptrs
    peer.data_ptrs = flag_ptrs + flag_bytes(peer.programs, len(handle.buffer_ptrs))
