"""Skinny matmul for decode: y = x @ w.T (+ bias) for few rows (M <= 64), streaming w once.

For small weights cuBLAS adds a separate split-K reduce kernel or uses few SMs; in CUDA graphs on
an H100 this kernel measured ~10% faster on Qwen2.5-0.5B's qkv, o and down projections at 16 and
64 rows, and no faster on larger weights (bench/NOTES.md, 2026-11-23), hence MAX_WEIGHT_BYTES.
Each program owns BLOCK_N output columns and a 1/SPLIT share of K;
with SPLIT > 1 the programs of a column tile write float32 partials and the last one to arrive
(an atomic counter per tile) sums them in split order, so the result does not depend on timing.
The counters are left at zero for the next launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.attn_common import mma
from kernels.launch import arrival_counters, cdiv, launch, next_pow2
from kernels.pdl import prefetch_l2, wait_for_prior

MAX_M = 64


@triton.jit
def _epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, N, tile_mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


# M (rows) changes with every eager step's batch; specializing on it (== 1, % 16) would compile
# new variants mid-serving
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, split,
                   stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr, SPLIT_ONE: tl.constexpr, SWAP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr, LINES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL and LINES > 0:
        # this program's weights (which no kernel writes) into L2 while the previous kernel
        # finishes; 64 elements = one 128-byte line of a 16-bit weight (the wrapper checks)
        lines = tl.minimum(k_lo + tl.arange(0, LINES) * 64, k_hi - 1)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        prefetch_l2(w_ptr + rows[:, None] * stride_wn + lines[None, :])
    wait_for_prior(PDL)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of BLOCK_K (the wrapper checks), so only rows and columns are masked
    for _ in range(k_lo, k_hi, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        if SWAP:
            acc += mma(w, tl.trans(x), NATIVE)
        else:
            acc += mma(x, tl.trans(w), NATIVE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n, M, N, split, stride_om,
            HAS_BIAS, SPLIT_ONE)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid's (row tile, column tile) of an [M, N] output: consecutive programs take GROUP_M
    row tiles of one column tile, so the weight tiles they share are read from L2."""
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n, M, N, split, stride_om,
            HAS_BIAS: tl.constexpr, SPLIT_ONE: tl.constexpr):
    """The program's [BLOCK_M, BLOCK_N] float32 tile into out, or, with a K split, into its partial;
    the last of the tile's programs to arrive sums the partials in split order and writes out."""
    tile = offs_m[:, None] * N + offs_n[None, :]
    tile_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_ONE:
        _epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, N, tile_mask, stride_om, HAS_BIAS)
    else:
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial is stored before the count goes up
        # acq_rel: this program's partial is visible to the one that sees the last count
        arrived = tl.atomic_add(count_ptr + pid_n, 1)
        if arrived == split - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, split):
                total += tl.load(part_ptr + s * M * N + tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            _epilogue(total, b_ptr, out_ptr, offs_m, offs_n, N, tile_mask, stride_om, HAS_BIAS)


@dataclass(frozen=True)
class Plan:
    block_n: int
    block_k: int
    split: int
    swap: bool
    num_warps: int = 4
    num_stages: int = 4
    prefetch: bool = True  # with PDL, the weights into L2 before the wait


# Used for weights up to this size; larger ones (Llama-3-8B's, Qwen's gate_up and lm_head) measured
# as fast or faster with cuBLAS at M = 64 (bench/NOTES.md, 2026-11-23), but for a long K (below).
MAX_WEIGHT_BYTES = 16 << 20
# Larger weights over a long K with few output columns (an MLP's down projection into a hidden size
# of at most 4,096: K >= 1.75 N), where cuBLAS splits K and adds a reduce kernel, stream faster
# here, in 64-column tiles with K split in two. H100, 64 rows, cold L2 (bench/NOTES.md, 2026-11-27):
# Llama-3-8B's down 45.7 against 46.2 us at TP=1, 25.2 against 27.4 at TP=2, the TP=2 decode step
# 4.66 against 4.73 ms; Llama-3-70B's at TP=2 (N = 8,192) 89.0 against cuBLAS's 82.0, which reads
# it at 95% of the copy bandwidth. They launch with PDL but prefetch nothing: the kernel before
# them (the gate/up matmul) streams weights of its own, and with a prefetch the TP=2 step took
# 4.86 ms.
LONG_K_PLAN = Plan(64, 128, 2, swap=False, prefetch=False)
LONG_K_RATIO = 1.75
LONG_K_MAX_N = 4096


def plan(M: int, N: int, K: int) -> Plan:
    """Tiles from an H100 sweep (Qwen2.5-0.5B's projections, M = 16 and 64, CUDA graphs): 16-column
    tiles over a short K, 32 columns and a split over a long one (~8 K steps a split); x as the
    dot's B operand (swap) only for M <= 16."""
    block_k = 128 if K % 128 == 0 else 64
    steps = K // block_k
    split = 1
    while split < 8 and steps // (split * 2) >= 8:
        split *= 2
    return Plan(16 if split == 1 else 32, block_k, split, swap=M <= 16)


def supports(x: torch.Tensor, w: torch.Tensor) -> Plan | None:
    """The plan skinny_linear takes x [M, K] and w [N, K] with where it should, else None: plan()'s
    up to MAX_WEIGHT_BYTES, LONG_K_PLAN for a larger weight over a long K into few columns."""
    N, K = w.shape
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.shape[1] == K
            and K % 64 == 0 and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and w.stride(1) == 1):
        return None
    if w.numel() * w.element_size() <= MAX_WEIGHT_BYTES:
        return plan(x.shape[0], N, K)
    if N <= LONG_K_MAX_N and K >= LONG_K_RATIO * N and K % LONG_K_PLAN.block_k == 0:
        return LONG_K_PLAN
    return None


def k_split(out: torch.Tensor, K: int, p: Plan) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """A launch of plan p into out [M, N] over K: (column tiles, K per split, splits, the float32
    partials and the arrival counters, out itself for both where K is not split)."""
    tiles = cdiv(out.shape[1], p.block_n)
    k_per_split = cdiv(K // p.block_k, p.split) * p.block_k
    split = cdiv(K, k_per_split)
    return tiles, k_per_split, split, *split_buffers(out, split, tiles)


def split_buffers(out: torch.Tensor, split: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What _finish sums a K split of `tiles` output tiles in: the float32 partials [split, M, N] and
    the tiles' arrival counters; out itself for both where K is not split."""
    if split == 1:
        return out, out
    part = torch.empty((split, *out.shape), dtype=torch.float32, device=out.device)
    return part, arrival_counters(out.device, tiles)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, p: Plan | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T + bias -> [M, N] in x's dtype, for M <= 64 and K a multiple of 64.
    pdl: launch with programmatic dependent launch (kernels/pdl.py), prefetching the weights where
    the plan says so."""
    M = x.shape[0]
    N, K = w.shape
    assert x.dim() == 2 and x.shape[1] == K and K % 64 == 0 and M <= MAX_M
    assert x.stride(1) == 1 and w.stride(1) == 1 and x.dtype == w.dtype
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1 and out.dtype == x.dtype
    if bias is not None:
        assert bias.shape == (N,) and bias.is_contiguous()
    if M == 0:
        return out
    p = p or plan(M, N, K)
    assert K % p.block_k == 0
    tiles, k_per_split, split, part, counters = k_split(out, K, p)
    pdl = pdl and x.is_cuda
    launch(_skinny_kernel, (tiles, split),
           x, w, bias if bias is not None else w, out, part, counters, M, N, K, k_per_split, split,
           x.stride(0), w.stride(0), out.stride(0),
           HAS_BIAS=bias is not None, NATIVE=x.is_cuda, SPLIT_ONE=split == 1, SWAP=p.swap,
           BLOCK_M=max(16, next_pow2(M)), BLOCK_N=p.block_n, BLOCK_K=p.block_k,
           PDL=pdl, LINES=min(128, next_pow2(cdiv(k_per_split, 64))) if pdl and p.prefetch else 0,
           num_warps=p.num_warps, num_stages=p.num_stages, launch_pdl=pdl)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The engine's projection: skinny_linear where supports() gives a plan, cuBLAS otherwise."""
    p = supports(x, weight)
    if p is not None:
        return skinny_linear(x, weight, bias, out, p, pdl=pdl)
    return reference.linear(x, weight, bias, out)

