"""4-bit weights with 16-bit activations (W4A16): y = x @ dequantized(w).T for a weight held as
eight 4-bit values an int32 along K, with a float16 scale and a uint8 zero point per output row and
group of G input columns (engine/int4.py): w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G].

On Hopper, 16-bit x of up to int4_wgmma.MAX_M rows take kernels/int4_wgmma.py's Gluon kernel
instead (1.7-2.2x faster at decode's rows). This module's Triton kernel serves the rest: it reads
each weight tile once as 4-bit words and takes each nibble position as it is
(engine/int4.py lays a 128-column block's 16 words out so that nibble j holds 16 consecutive
columns: one shift and mask give an MMA operand, with no shuffle of values between threads). The
values 0-15 are exact 16-bit operands; x's columns multiply them on the tensor cores, and each
group's float32 sum d becomes scale * (d - zero * sum of x over the group), so the scales and zero
points touch only the accumulator. A decode step reads about a quarter of a 16-bit weight's bytes.
K is split over programs for few rows, the partials summed in split order as kernels/linear.py
does. More rows (prompts), and weights whose K is not in whole 128-column blocks, take
dequantize() into a 16-bit scratch weight and cuBLAS (DEQUANT_MIN_ROWS). reference.int4_linear
computes the same in torch ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import int4_wgmma, reference
from kernels.attn_common import mma
from kernels.fused import gather_columns, silu_and_mul
from kernels.launch import cdiv, launch, next_pow2, sm_count, split_count
from kernels.linear import _finish, grouped_tile, split_buffers
from kernels.pdl import wait_for_prior

PACK = 8  # 4-bit values per int32


PLANE = 16  # the columns of one nibble position across a 128-column block's 16 words: one MMA's K
BLOCK_K = 8 * PLANE


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, split,
                  stride_xm, stride_wn, stride_sg, stride_om,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr, SPLIT_ONE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PLANE: tl.constexpr,
                  GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """out^T tile [BLOCK_N, BLOCK_M] = W x^T: per 128-column block, nibble position j of its 16
    words is W's columns 16j..16j+15 (engine/int4.py), multiplied as they are (0-15, exact in 16
    bits) with x's same 16 columns; each group's sum d then becomes scale * (d - zero * sum(x))."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, PLANE)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    wait_for_prior(PDL)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo // 8 + offs_c)[None, :]
    x_rows = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    x_ptrs = x_rows + (k_lo + offs_c)[:, None]
    PLANES: tl.constexpr = GROUP // PLANE if GROUP < BLOCK_K else 8  # planes a scale covers
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):  # K and the split are multiples of BLOCK_K (the wrapper checks)
        words = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
        d = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if PLANES == 8:  # the block's sum of x at once (a per-plane sum costs a reduction each)
            xsum = tl.sum(tl.load(x_rows + (k + tl.arange(0, BLOCK_K))[:, None], mask=m_mask[None, :],
                                  other=0.0).to(tl.float32), axis=0)
        else:
            xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptrs + j * PLANE, mask=m_mask[None, :], other=0.0)
            if NATIVE:
                q = ((words >> (4 * j)) & 0xF).to(x_ptr.dtype.element_ty)
            else:  # the interpreter's integer -> bf16 conversion is wrong: through float32
                q = ((words >> (4 * j)) & 0xF).to(tl.float32).to(x_ptr.dtype.element_ty)
            d += mma(q, x, NATIVE)
            if PLANES < 8:
                xsum += tl.sum(x.to(tl.float32), axis=0)
            if (j + 1) % PLANES == 0:
                g = (k + j * PLANE) // GROUP
                scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_mask, other=0).to(tl.float32)
                acc += d * scale[:, None] - (zero * scale)[:, None] * xsum[None, :]
                d = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        w_ptrs += BLOCK_K // 8
        x_ptrs += BLOCK_K
    _finish(tl.trans(acc), b_ptr, out_ptr, part_ptr, count_ptr, pid, pid_k, offs_m, offs_n, M, N, split, stride_om,
            HAS_BIAS, SPLIT_ONE)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sg, stride_on,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                       PDL: tl.constexpr):
    """BLOCKS blocks of BLOCK columns of BLOCK_N rows, each written as one [BLOCK_N, BLOCK] tile of
    whole rows (nibble j of word c is column j * BLOCK/8 + c of its block): 0.68-0.75 of the copy
    bound on an H200 where one store a nibble plane reached 0.64-0.67 (bench/NOTES.md, 2026-11-29)."""
    W: tl.constexpr = BLOCK // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    plane = tl.arange(0, 8)
    offs_c = tl.arange(0, W)
    shifts = (4 * plane)[None, :, None]
    wait_for_prior(PDL)
    for b in tl.static_range(BLOCKS):
        blk = tl.program_id(1) * BLOCKS + b
        ok = (offs_n < N) & (blk * BLOCK + 0 * offs_n < K)  # a block past K: the grid's last program's
        words = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + blk * W + offs_c[None, :],
                        mask=ok[:, None], other=0)
        g = (blk * BLOCK + plane * W) // GROUP  # each plane's W columns lie in one group
        at = g[None, :] * stride_sg + offs_n[:, None]
        scale = tl.load(s_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + at, mask=ok[:, None], other=0).to(tl.float32)
        q = ((words[:, None, :] >> shifts) & 0xF).to(tl.float32)
        w = (q - zero[:, :, None]) * scale[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK))
        tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + blk * BLOCK + tl.arange(0, BLOCK)[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def group_of(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> int:
    """The input columns one scale covers, checking the three tensors' shapes and dtypes."""
    N, K8 = w.shape
    K = K8 * PACK
    groups = scale.shape[0]
    assert w.dtype == torch.int32 and scale.dtype == torch.float16 and zero.dtype == torch.uint8, \
        "a 4-bit weight is int32 words with float16 scales and uint8 zero points"
    assert scale.shape == zero.shape == (groups, N) and K % groups == 0 and scale.stride(1) == zero.stride(1) == 1, \
        f"scales and zero points of a [{N}, {K}] 4-bit weight must be [K / group, {N}]"
    return K // groups


@dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    split: int
    warps: int = 4
    stages: int = 3


def plan(M: int, N: int, K: int, sms: int) -> Plan:
    """The weight as the MMA's wide operand, x's rows as its narrow one (up to 64 a tile); 64-row
    weight tiles (128 past 16 rows; 8 warps for the largest tiles, whose two float32 accumulators
    spill with 4), K split until the grid covers the GPU about three times, two stages: the best
    plans of a sweep on an H200 (Llama-3-8B's projections, 16 and 64 rows, bench/NOTES.md
    2026-11-28) or within 15% of them."""
    block_m = max(16, min(64, next_pow2(M)))
    block_n = 64 if M <= 16 else 128
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    steps = K // BLOCK_K
    split = split_count(tiles, steps, 2.9 * sms, min_steps=2, most=8)
    return Plan(block_m, block_n, split, warps=8 if block_m * block_n > 4096 else 4, stages=2)


def supports(w: torch.Tensor, group: int) -> bool:
    """Whether w4a16_matmul takes this weight: K in whole 128-column blocks, groups of at least 16."""
    return (w.shape[1] * PACK) % BLOCK_K == 0 and group >= PLANE


def w4a16_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = False,
                 p: Plan | None = None, hopper: bool | None = None) -> torch.Tensor:
    """x [M, K] (16- or 32-bit) @ the 4-bit weight w [N, K/8] with scale, zero [K/G, N] -> [M, N]
    in x's dtype (+ bias); K a multiple of 128 (supports()). On Hopper, 16-bit x of up to MAX_M rows
    (int4_wgmma) take its kernel (hopper=False: this module's, for the tests and lab)."""
    M, K = x.shape
    N = w.shape[0]
    group = group_of(w, scale, zero)
    assert w.shape[1] * PACK == K and supports(w, group) and x.stride(1) == 1 and w.stride(1) == 1
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1 and out.dtype == x.dtype
    if M == 0:
        return out
    pdl = pdl and x.is_cuda
    if hopper is not False and p is None and int4_wgmma.supports(x, K, group):
        return int4_wgmma.w4a16_matmul(x, w, scale, zero, group, bias, out, pdl=pdl)
    if p is None:
        p = plan(M, N, K, sm_count(x.device) if x.is_cuda else 132)
    k_per_split = cdiv(K // BLOCK_K, p.split) * BLOCK_K
    split = cdiv(K, k_per_split)
    tiles = cdiv(M, p.block_m) * cdiv(N, p.block_n)
    part, counters = split_buffers(out, split, tiles)
    launch(_w4a16_kernel, (tiles, split), x, w, scale, zero, bias if bias is not None else out, out, part, counters,
           M, N, K, k_per_split, split, x.stride(0), w.stride(0), scale.stride(0), out.stride(0),
           GROUP=group, HAS_BIAS=bias is not None, NATIVE=x.is_cuda and x.dtype != torch.float32,
           SPLIT_ONE=split == 1, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=BLOCK_K, PLANE=PLANE, GROUP_M=8,
           PDL=pdl, num_warps=p.warps, num_stages=p.stages, launch_pdl=pdl)
    return out


def dequantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype,
               pdl: bool = False, block_n: int = 32, blocks: int = 2, warps: int = 4) -> torch.Tensor:
    """The 4-bit weight [N, K/8] -> [N, K] in dtype, each value (q - zero) * scale rounded once. The
    plan (32 rows, two blocks a program, 4 warps) was the best of a sweep on Llama-3-8B's
    projections or within 0.5% of it (H200, lab/int4_dequant.py)."""
    N = w.shape[0]
    group = group_of(w, scale, zero)
    K = w.shape[1] * PACK
    block = reference.int4_block(K)
    out = torch.empty((N, K), dtype=dtype, device=w.device)
    pdl = pdl and w.is_cuda
    launch(_dequantize_kernel, (cdiv(N, block_n), cdiv(K // block, blocks)), w, scale, zero, out, N, K,
           w.stride(0), scale.stride(0), out.stride(0), GROUP=group, BLOCK=block, BLOCK_N=block_n, BLOCKS=blocks,
           PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


# More rows than this dequantize the weight and multiply with cuBLAS, where Hopper's kernel does not
# apply (its own limit: int4_wgmma.MAX_M): at 128-256 rows of Llama-3-8B's projections this module's
# kernel took 2.4-4.8x the time of dequantization + cuBLAS (H200, bench/NOTES.md, 2026-11-28); the 8B
# served 0.20x bf16's tok/s with them on it
DEQUANT_MIN_ROWS = 64


def int4_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = False,
                order: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's 4-bit projection: w4a16_matmul for up to DEQUANT_MIN_ROWS rows (int4_wgmma.MAX_M on
    Hopper), else the weight dequantized to x's dtype and cuBLAS. order: the weight's columns are
    x's in this order (groups in activation order): x is gathered first."""
    if order is not None:
        x = gather_columns(x, order, pdl=pdl)
    group = group_of(w, scale, zero)
    few = x.shape[0] <= DEQUANT_MIN_ROWS or not x.is_cuda or int4_wgmma.supports(x, x.shape[1], group)
    if few and supports(w, group):
        return w4a16_matmul(x, w, scale, zero, bias, out, pdl=pdl)
    return reference.linear(x, dequantize(w, scale, zero, x.dtype, pdl=pdl), bias, out)


def int4_gate_up_silu(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      pdl: bool = False, order: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's activation with a 4-bit gate_up weight [2I, K]: silu(gate) * up [M, I] in x's dtype."""
    return silu_and_mul(int4_linear(x, w, scale, zero, pdl=pdl, order=order), pdl=pdl)
