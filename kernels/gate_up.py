"""The MLP's gate/up projection with SiLU-and-multiply in the epilogue: silu(x @ Wg.T) * (x @ Wu.T).

w is the model's gate_up weight [2I, K], gate rows then up rows. A program owns BLOCK_M rows and
BLOCK_N columns of the [M, I] result and keeps two float32 accumulators: the gate tile (rows
n0.. of w) and the up tile (rows I + n0..) are loaded for each K step and multiplied with the same
x tile. The unfused path writes the [M, 2I] product and reads it back for the SiLU kernel; for a
prefill of a few thousand tokens that is most of the time the activation costs (Qwen2.5-0.5B,
3,328 tokens: the SiLU kernel 35 us a layer at the copy bandwidth, bench/NOTES.md, 2026-11-23).

The epilogue rounds gate and up to x's dtype first, as the unfused GEMM's output is, then computes
the SiLU in float32, rounds it, and multiplies, as kernels/fused.py's silu_and_mul does.
x and w go through TMA descriptors (Hopper; the interpreter emulates them); rows past M, columns
past K and up rows past 2I come back zero-filled; a last gate tile that runs past I reads up rows,
and the store masks those columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attn_common import mma
from kernels.fused import silu_and_mul
from kernels.launch import TensorDescriptor, cdiv, launch, next_pow2
from kernels.linear import MAX_M, grouped_tile, linear
from kernels.pdl import prefetch_l2, wait_for_prior


# With prefetch, the most of its weights the kernel pulls into L2 while the fused cross-GPU sum before
# it runs: about what the copy bandwidth moves in that sum's ~8 us, well inside the 50 MB L2.
PREFETCH_MAX_BYTES = 24 << 20


# M is each step's token count: no specialization on it (no compiles mid-serving)
@triton.jit(do_not_specialize=["M"])
def _gate_up_kernel(x_desc, w_desc, w_ptr, out_ptr, M, I, K, stride_wn, stride_om, prefetch_k,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, NATIVE: tl.constexpr,
                    PDL: tl.constexpr, LINES: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, I, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    if PDL and LINES > 0:
        # the first prefetch_k columns of this program's gate and up rows into L2 while the kernel
        # before (a cross-GPU sum) finishes; 64 elements = one 128-byte line (16-bit weights)
        rows = tl.minimum(n0 + tl.arange(0, BLOCK_N), I - 1).to(tl.int64)
        lines = tl.minimum(tl.arange(0, LINES) * 64, prefetch_k - 1)
        prefetch_l2(w_ptr + rows[:, None] * stride_wn + lines[None, :])
        prefetch_l2(w_ptr + (I + rows)[:, None] * stride_wn + lines[None, :])
    wait_for_prior(PDL)

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([m0, k])
        g = w_desc.load([n0, k])
        u = w_desc.load([I + n0, k])
        if NATIVE:
            acc_g = tl.dot(x, g.T, acc_g)
            acc_u = tl.dot(x, u.T, acc_u)
        else:
            acc_g += mma(x, g.T, NATIVE)
            acc_u += mma(x, u.T, NATIVE)

    dt = out_ptr.dtype.element_ty
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], (act * up).to(dt), mask=mask)


@dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def plan(M: int, I: int, K: int) -> Plan | None:
    """The fused kernel's tiles for M rows, or None where the unfused path (cuBLAS, then the SiLU
    kernel) measured as fast or faster. H100 sweep (lab/gate_up.py, bench/NOTES.md, 2026-11-23):
    decode batches 1.08-1.17x in CUDA graphs (Qwen2.5-0.5B and Llama-3-8B shapes, cold
    L2); prefills with a short K (Qwen2.5-0.5B, K = 896) 1.12-1.17x from 1,024 rows; with K = 4,096
    (Llama-3-8B) about even from 2,048 rows (0.99-1.05x: the GEMM dominates; the [M, 2I] product
    is never stored) and slower at 512."""
    if M <= 64:
        return Plan(max(16, next_pow2(M)), 32, 128, 4, 3)
    if M >= 1024 and K <= 2048:
        return Plan(128, 64, 64, 8, 3, 16)
    if M >= 2048:
        return Plan(128, 128, 64, 8, 3, 16)
    return None


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gate_up_silu takes x [M, K] and w [2I, K] (16-bit, rows 16-byte aligned for TMA)."""
    e = x.element_size()
    return (TensorDescriptor is not None and x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]
            and w.shape[0] % 2 == 0 and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and w.stride(1) == 1 and (x.stride(0) * e) % 16 == 0
            and (w.stride(0) * e) % 16 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, p: Plan | None = None, prefetch: bool = False) -> torch.Tensor:
    """x [M, K], w [2I, K] (gate rows, then up rows) -> silu(x @ w[:I].T) * (x @ w[I:].T) [M, I].
    prefetch: launch with PDL and pull the first columns of the weights, PREFETCH_MAX_BYTES in all,
    into L2 before waiting for the kernel before: for a kernel before that leaves the memory idle
    (the fused cross-GPU sum, waiting on NVLink)."""
    assert supports(x, w), "gate_up_silu needs 16-bit x [M, K] and w [2I, K], rows contiguous and 16-byte aligned"
    M, K = x.shape
    I = w.shape[0] // 2
    out = torch.empty((M, I), dtype=x.dtype, device=x.device)
    if M == 0 or I == 0:
        return out
    p = p or plan(M, I, K)
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [p.block_m, p.block_k])
    w_desc = TensorDescriptor(w, [2 * I, K], [w.stride(0), 1], [p.block_n, p.block_k])
    grid = (cdiv(M, p.block_m) * cdiv(I, p.block_n),)
    pdl = prefetch and x.is_cuda
    # 128-byte lines a weight row, the same first ones of every row
    lines = min(cdiv(K, 64), PREFETCH_MAX_BYTES // (2 * I * 128)) if pdl else 0
    launch(_gate_up_kernel, grid, x_desc, w_desc, w, out, M, I, K, w.stride(0), out.stride(0), lines * 64,
           BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
           NUM_STAGES=p.num_stages, NATIVE=x.is_cuda, PDL=pdl, LINES=next_pow2(lines) if lines else 0,
           num_warps=p.num_warps, launch_pdl=pdl)
    return out


def mlp_gate_up(x: torch.Tensor, w: torch.Tensor, pdl: bool = False, prefetch: bool = False) -> torch.Tensor:
    """The engine's MLP activation: gate_up_silu where plan() picks it, else the GEMM (kernels/linear.py)
    and kernels/fused.py's silu_and_mul. Same result as reference.gate_up_silu.

    pdl applies to the unfused path's kernels only. The fused kernel launches the usual way: with
    PDL (its weights prefetched or not) the decode step was slower than without, because the
    kernel after it starts early and competes (H100, Qwen2.5-0.5B decode only, one call: 48,965
    tok/s with PDL and no prefetch, 50,004 without PDL; bench/NOTES.md, 2026-11-23). With prefetch
    (and pdl) decode rows take it with PDL after all: the kernel before is then the fused cross-GPU
    sum, which leaves the memory idle (Llama-3-8B's TP=2 decode step 4.80 against 4.88 ms on two
    H100s, bench/NOTES.md, 2026-11-27)."""
    p = plan(x.shape[0], w.shape[0] // 2, w.shape[1]) if supports(x, w) else None
    if p is None:
        return silu_and_mul(linear(x, w, pdl=pdl), pdl=pdl)
    return gate_up_silu(x, w, p, prefetch=pdl and prefetch and x.shape[0] <= MAX_M)
