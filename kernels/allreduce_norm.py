"""The all-reduce of a row-parallel projection, fused with the residual add and RMSNorm after it.

Under tensor parallelism each layer ends its attention and its MLP with a projection whose output
every rank holds a part of; the parts are summed over the ranks (an all-reduce) and the sum goes
into the residual add and RMSNorm of what follows. A decode step of Llama-3-8B at TP=2 did that
64 times, as NCCL's all-reduce (~10 us inside a CUDA graph) and then the norm's kernel. Here one
kernel does both, over NVLink peer memory: the ranks exchange their rows through buffers that every
rank maps (torch's symmetric memory, engine/parallel/peer_allreduce.py) and signal each other, each
adds the ranks' rows in rank order (every rank computes the same bits), rounds the sum to the
model's dtype as the all-reduce would, and then adds the residual and normalizes as
kernels/fused.py's rms_norm does.

Up to PUSH_MAX_BYTES each rank writes its rows into the other ranks' memory (NVLink writes, which
need no answer) and then reads every rank's from its own; above it each rank writes its rows into
its own memory and reads the others' over NVLink, which moves large messages faster. On two H100s
(lab/allreduce.py, 2026-11-27, bench/results/allreduce-push-h100-2026-11-27.json) pushing took
7.7 against 9.7 us at 64 x 4,096 bf16 and 10.9 against 11.3 at 64 x 8,192, and lost from 4 MiB
(48 against 37 us at 1,024 x 4,096), both ways then in 2-byte accesses (16-byte vectors since; the
limit not measured again: `python -m lab.allreduce --fused-only --push-max-mib M`).

Each rank's buffer holds flags, then two halves for the rows read by the peers, then two halves for
the rows pushed by them, each half used by turns with a slot for every other rank (or, read, one
for its own). Program b always takes the rows congruent to b modulo the fixed program count G,
whatever the number of rows, so program b of one rank only ever meets program b of the others;
each counts its calls (its epoch, kept in its rank's flags, the same count on every rank: every
rank launches the same programs) and uses the halves of its epoch's parity.

Pushed rows carry their own signal: a pushed half starts all zero bits, no pushed value has them
(a +0.0 goes as -0.0, which adds the same to a sum that starts at +0.0), and a program reads a
peer's row until none of its values is all zero bits, then zeroes it for its next use. No flag and
no fence: a release store at system scope waits for the rows' NVLink writes to be acknowledged
first. Read rows need the flags: a program writes its rows into its own half, stores the epoch into
the peers' READY[b][rank] (a release store at system scope: the peers are other GPUs; the barrier
before it orders every thread's rows first) and waits until every peer's READY[b][s] holds it,
then reads the peers' rows over NVLink.

A half is written again two calls later, after program b has seen every peer's rows or READY of
the call between, which a peer sends only after it finished the call before, reads and zeroing
included (stream order, whichever way either call took): no handshake when done. Every launch's
programs fit on the GPU at once (G <= SMs) and a program waits only for program b of its peers, so
the waits can't form a cycle.

On GPUs the buffers are peer memory; under Triton's interpreter, processes forked with shared
buffers (the same addresses in each) stand for the ranks (tests/kernels/test_allreduce_norm.py).
kernels/reference.py's rms_norm after a sum is the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch, next_pow2
from kernels.pdl import wait_for_prior


PUSH_MAX_BYTES = 2 << 20


def slots(world: int) -> int:
    """Slots of rows in each half of a rank's buffer: one for every other rank (at least one)."""
    return max(world - 1, 1)


def push_slot_bytes(slot_bytes: int) -> int:
    """A pushed slot's bytes for read slots of slot_bytes: the largest message that is pushed."""
    return min(slot_bytes, PUSH_MAX_BYTES)


def pushes(nbytes: int, slot_bytes: int) -> bool:
    """Whether a message of nbytes goes into the peers' memory (else they read it from this rank's)."""
    return nbytes <= push_slot_bytes(slot_bytes)


def row_bytes(slot_bytes: int, world: int) -> int:
    """Bytes of rows after the flags in each rank's buffer: two halves of slots(world) slots of
    slot_bytes read by the peers, then two of push_slot_bytes pushed by them. All zero bits at
    first (the pushed halves must be)."""
    return 2 * slots(world) * (slot_bytes + push_slot_bytes(slot_bytes))


def flag_bytes(programs: int, world: int) -> int:
    """Bytes of flags at the start of each rank's buffer (int32 READY[G][world], then EPOCH[G]),
    rounded up to 256 (the rows' alignment). Every flag starts at 0."""
    return -(-4 * programs * (world + 1) // 256) * 256


@triton.jit
def _poll(flag, epoch):
    """Wait until flag holds epoch (or the next one: that peer went on already)."""
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    while (seen != epoch) & (seen != epoch + 1):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")


@triton.jit
def _bits(v):
    """v's bits as integers of its width."""
    if v.dtype.primitive_bitwidth == 16:
        return v.to(tl.int16, bitcast=True)
    else:
        return v.to(tl.int32, bitcast=True)


@triton.jit
def _pushed(v):
    """v with each value of all zero bits (+0.0) made -0.0: a pushed value is never all zero bits."""
    b = _bits(v)
    return tl.where(b == 0, tl.full(b.shape, -(1 << (v.dtype.primitive_bitwidth - 1)), b.dtype), b).to(
        v.dtype, bitcast=True)


@triton.jit
def _rows_of(data_ptrs, s, like):
    """Rank s's rows, as pointers of like's type. They start 256-byte aligned (flag_bytes): said
    so, the rows move as 16-byte vectors, not as 2-byte NVLink writes and reads."""
    return tl.multiple_of(tl.load(data_ptrs + s).to(like.dtype), 16)


@triton.jit(do_not_specialize=["rank", "rows"])  # one compile for every row count (compiled before captures)
def _allreduce_add_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, data_ptrs, flag_ptrs, rank, rows, N,
                               eps, stride_x, stride_r, stride_o, stride_ro, SLOT, PSLOT,
                               G: tl.constexpr, WORLD: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
                               HAS_RES: tl.constexpr, PUSH: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = x_ptr.dtype.element_ty
    # Before the wait (a PDL launch starts during the projection before it), only what that
    # projection does not write: the buffers' addresses, this program's epoch (its last call
    # stored it), the norm's weight, and the first row of the residual, which the sum before
    # that projection wrote: the projection passed its own wait, so that sum has finished.
    flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    epoch = tl.load(flags + G * WORLD + b, volatile=True) + 1  # int32: wraps, compared only for equality
    parity = (epoch & 1).to(tl.int64)
    if PUSH:  # this call's pushed half, after the read ones (elements from a rank's rows)
        half = 2 * SLOTS * SLOT + parity * (SLOTS * PSLOT)
    else:
        half = parity * (SLOTS * SLOT)
    mine = _rows_of(data_ptrs, rank, x_ptr) + half
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r_next = tl.load(r_ptr + b * stride_r + cols, mask=mask & (b + 0 * cols < rows), other=0.0)
    wait_for_prior(PDL)
    if PUSH:  # into this rank's slot of every peer's half (NVLink writes, which need no answer)
        for i in range(b, rows, G):
            v = _pushed(tl.load(x_ptr + i * stride_x + cols, mask=mask))
            for s in tl.static_range(WORLD):
                if s != rank:
                    slot = rank - (rank > s).to(tl.int32)  # the peers' slots skip their own rank
                    dst = _rows_of(data_ptrs, s, x_ptr) + half + slot.to(tl.int64) * PSLOT
                    tl.store(dst + i * N + cols, v, mask=mask)
    else:  # into the first slot of this rank's own half, for the peers to read, then READY
        for i in range(b, rows, G):
            tl.store(mine + i * N + cols, tl.load(x_ptr + i * stride_x + cols, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's rows before the stores that release them
        for s in tl.static_range(WORLD):
            if s != rank:
                peer_flags = tl.load(flag_ptrs + s).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer_flags + b * WORLD + rank, epoch, sem="release", scope="sys")
        for s in tl.static_range(WORLD):
            if s != rank:
                _poll(flags + b * WORLD + s, epoch)
        tl.debug_barrier()
    for i in range(b, rows, G):  # offsets stay far below 2**31: the rows fit the peer buffer
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(WORLD):  # rank order: every rank adds the same values the same way
            if s == rank:
                v = tl.load(x_ptr + i * stride_x + cols, mask=mask, other=0.0)
            elif PUSH:  # what rank s wrote here: complete once no value is all zero bits
                src = mine + (s - (s > rank)) * PSLOT + i * N + cols
                v = tl.load(src, mask=mask, other=0.0, volatile=True)
                while tl.sum(((_bits(v) == 0) & mask).to(tl.int32), axis=0) > 0:
                    v = tl.load(src, mask=mask, other=0.0, volatile=True)
                tl.store(src, tl.zeros([BLOCK], dtype=dt), mask=mask)  # zero again for its next use
            else:  # every other rank's first slot, over NVLink
                src = _rows_of(data_ptrs, s, x_ptr) + half
                v = tl.load(src + i * N + cols, mask=mask, other=0.0, cache_modifier=".cv")
            acc += v.to(tl.float32)
        h = acc.to(dt)  # the all-reduce's result, as the unfused path has it
        if HAS_RES:
            r = r_next
            r_next = tl.load(r_ptr + (i + G) * stride_r + cols, mask=mask & (i + G + 0 * cols < rows), other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + i * stride_ro + cols, h, mask=mask)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / N
        normed = (hf * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
        tl.store(out_ptr + i * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(flags + G * WORLD + b, epoch)


def allreduce_add_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       data_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, rank: int, programs: int,
                       slot_bytes: int, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N]: this rank's part of a sum over the ranks -> (RMSNorm(sum + residual) * weight, sum +
    residual), as rms_norm(all_reduce(x), weight, eps, residual) computes them (without residual:
    the sum is the new residual stream). Every rank of the group calls it with the same shapes.

    data_ptrs, flag_ptrs: int64 [world] on this GPU, each rank's rows (row_bytes(slot_bytes, world),
    slot_bytes room for T x N of x's dtype) and flags (flag_bytes(programs, world)), zeros at
    first, in peer memory; programs: the group's fixed program count (at most the GPU's SMs)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, N], rows contiguous"
    T, N = x.shape
    assert weight.shape == (N,) and weight.is_contiguous()
    world = data_ptrs.numel()
    out = torch.empty((T, N), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    r = residual if residual is not None else x
    assert T * N * x.element_size() <= slot_bytes and slot_bytes % x.element_size() == 0
    assert r.shape == x.shape and r.dtype == x.dtype and r.stride(-1) == 1
    if T:
        block = next_pow2(N)
        launch(_allreduce_add_norm_kernel, (min(T, programs),),
               x, r, weight, out, res_out, data_ptrs, flag_ptrs, rank, T, N, eps,
               x.stride(0), r.stride(0), out.stride(0), res_out.stride(0), slot_bytes // x.element_size(),
               push_slot_bytes(slot_bytes) // x.element_size(),
               G=programs, WORLD=world, SLOTS=slots(world), BLOCK=block, HAS_RES=residual is not None,
               PUSH=pushes(T * N * x.element_size(), slot_bytes), PDL=pdl,
               num_warps=min(16, max(1, block // 512)), launch_pdl=pdl)  # as rms_norm: the same sums
    return out, res_out
