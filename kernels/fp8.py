"""FP8 weights (W8A8): a projection whose weight is float8_e4m3fn with float32 scales multiplies
its input quantized to FP8 on the fly, on the FP8 tensor cores, with float32 accumulation.

Scales (engine/quant.py makes every checkpoint format into one of these):
- per output channel: w_scale [N, 1]; the input is quantized per row (token), x_scale [M, 1], and
  the product is scaled once at the end: y[m, n] = x_scale[m] * w_scale[n] * sum_k xq[m, k] wq[n, k];
- in 128 x 128 blocks (DeepSeek-V3 and Qwen3 FP8 checkpoints): w_scale [ceil(N/128), ceil(K/128)],
  or [N, ceil(K/128)] (a row of block scales per weight row) where the engine's packed q|k|v rows
  do not keep the blocks whole; the input is quantized per row and group of 128 columns, x_scale
  [M, ceil(K/128)], and each 128-wide K step's product is scaled before it is summed.

The input's scale is its largest magnitude over 448 (e4m3's largest finite value; at least
1 / (448 * 512), for a row of zeros), so it maps onto the whole FP8 range; the quotient is rounded
to nearest even, as torch's conversion does, and reference.fp8_linear does the same in torch ops.
Decode's few rows go through w8a8_matmul, which splits K over programs and sums their float32
partials in split order in the tile's last program (kernels/linear.py's _finish), so results do
not depend on timing; more rows through cuBLAS's FP8 GEMM (fp8_linear).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.fused import silu_and_mul
from kernels.launch import cdiv, launch, next_pow2, sm_count, split_count
from kernels.linear import _finish, grouped_tile, split_buffers
from kernels.pdl import wait_for_prior
from kernels.reference import FP8_GROUP

FP8 = torch.float8_e4m3fn
GROUP = FP8_GROUP  # the block size of block-scaled weights, along N and K


def group_of(w: torch.Tensor, w_scale: torch.Tensor) -> int:
    """The input's quantization group for weight w [N, K] with scales w_scale: K where one scale
    covers a row's whole K (w_scale [N or ceil(N/128), 1]), else GROUP."""
    N, K = w.shape
    assert w_scale.dtype == torch.float32 and w_scale.shape[0] in (N, cdiv(N, GROUP)) \
        and w_scale.shape[1] in (1, cdiv(K, GROUP)), \
        f"FP8 scales of a [{N}, {K}] weight must be [{N} or {cdiv(N, GROUP)}, 1 or {cdiv(K, GROUP)}]"
    return K if w_scale.shape[1] == 1 else GROUP


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
                     GROUP_K: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, group): the group's amax, then its quantized values; a group of at most
    BLOCK columns from one read of it, a longer one in BLOCK-wide pieces read twice."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    lo = g * GROUP_K
    end = tl.minimum(lo + GROUP_K, K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    wait_for_prior(PDL)
    if GROUP_K <= BLOCK:
        offs = lo + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
        scale = _scale(tl.max(tl.abs(v), axis=0))
        _store_quantized(v, scale, q_row + offs, offs < end, NATIVE)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(lo, end, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)))
        scale = _scale(tl.max(amax, axis=0))
        for k in range(lo, end, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
            _store_quantized(v, scale, q_row + offs, offs < end, NATIVE)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)


@triton.jit
def _scale(amax):
    # IEEE division, as torch's: the reference's scales bit for bit
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))


@triton.jit
def _store_quantized(v, scale, ptrs, mask, NATIVE: tl.constexpr):
    q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
    if not NATIVE:
        q = _round_to_e4m3(q)
    tl.store(ptrs, q.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(v):
    """v rounded to the nearest e4m3 value (ties to even) in float32. The GPU's conversion does
    this itself; Triton's CPU interpreter truncates, so its kernels round first and convert exactly."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3's subnormals share the smallest normal's step
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds a float32 below 2**22 to an integer
    r = ((v / step + magic) - magic) * step
    return tl.where(v < 0, -tl.abs(r), r)  # a negative value that rounds to zero keeps its sign


MAX_BLOCK = 16384  # the longest group read once (a per-channel weight's K: Llama-3-8B's down 14,336)


def quantize(x: torch.Tensor, group: int, pdl: bool = False,
             scales_by_column: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 values [M, K], float32 scales [M, ceil(K / group)]), as reference.quantize_fp8;
    scales_by_column: the scales' columns contiguous (cuBLAS's layout for block scales)."""
    M, K = x.shape
    assert x.dim() == 2 and x.stride(1) == 1
    groups = cdiv(K, group)
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    if scales_by_column:
        s = torch.empty((groups, M), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((M, groups), dtype=torch.float32, device=x.device)
    if M:
        pdl = pdl and x.is_cuda
        block = min(next_pow2(group), MAX_BLOCK)
        launch(_quantize_kernel, (M, groups), x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
               GROUP_K=group, BLOCK=block, NATIVE=x.is_cuda, PDL=pdl,
               num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, launch_pdl=pdl)
    return q, s


@triton.jit
def _dot(a, b, NATIVE: tl.constexpr, IMPRECISE: tl.constexpr):
    """a @ b of FP8 operands with float32 accumulation. Hopper's FP8 MMAs add with fewer bits than
    float32; Triton's default lets them accumulate a whole K so; IMPRECISE (>= 0) products at most
    before the sum moves into a float32 register, as cuBLAS does without its fast accumulation."""
    if not NATIVE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IMPRECISE >= 0:
        return tl.dot(a, b, max_num_imprecise_acc=IMPRECISE)
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, split,
                 stride_xm, stride_xs, stride_wn, stride_ws, stride_om,
                 BLOCKED: tl.constexpr, ROW_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr,
                 SPLIT_ONE: tl.constexpr, SWAP: tl.constexpr, IMPRECISE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    wait_for_prior(PDL)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_mask = (k + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SWAP:
            d = tl.trans(_dot(w, tl.trans(x), NATIVE, IMPRECISE))
        else:
            d = _dot(x, tl.trans(w), NATIVE, IMPRECISE)
        if BLOCKED:  # BLOCK_K == 128: one scale of the input's and one of the weight's per step
            g = k // BLOCK_K
            sx = tl.load(xs_ptr + offs_m * stride_xs + g, mask=m_mask, other=0.0)
            sw = tl.load(ws_ptr + (offs_n // ROW_GROUP) * stride_ws + g, mask=n_mask, other=0.0)
            acc += d * sx[:, None] * sw[None, :]
        else:
            acc += d
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCKED:
        sx = tl.load(xs_ptr + offs_m * stride_xs, mask=m_mask, other=0.0)
        sw = tl.load(ws_ptr + (offs_n // ROW_GROUP) * stride_ws, mask=n_mask, other=0.0)
        acc = acc * sx[:, None] * sw[None, :]
    _finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, pid, pid_k, offs_m, offs_n, M, N, split, stride_om,
            HAS_BIAS, SPLIT_ONE)


@dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    split: int
    swap: bool
    warps: int = 4
    stages: int = 4
    # products summed by the FP8 MMAs' own adder before a float32 add (0: none; -1: Triton's default,
    # all of K). Relative error against float32 sums (H200, Llama-3-8B's shapes, 64 rows): 0 -> 5e-7,
    # 32 (one MMA's K) -> 5e-5, all -> 1.3e-4; at 64 rows 0 cost 20-45% of the matmul's time and 32
    # nothing, so 16-bit outputs (rounded at 4e-3) take 32, float32 ones 0.
    imprecise: int = 32


def plan(M: int, N: int, K: int, sms: int) -> Plan:
    """Tiles for few rows (decode) from a sweep on an H200 (Llama-3-8B's projections at 16 and 64
    rows, CUDA graphs, bench/NOTES.md 2026-11-28): 32-column tiles where N and K are both small,
    else 64 (128 for a wide gate/up at more than 16 rows); the weight as the MMA's wide operand
    (swap) for few rows or a skinny weight; K split until the grid covers the GPU ~twice, unless the
    tiles alone fill it. Many rows take 128 x 128 tiles (where cuBLAS can't: fp8_linear)."""
    if M > 64:
        return Plan(128, 128, 1, swap=False, warps=8, stages=3)
    wide = N > 4 * K
    block_n = 32 if max(N, K) <= 8192 else 128 if wide and M > 16 else 64
    tiles = cdiv(N, block_n)
    steps = cdiv(K, GROUP)
    split = split_count(tiles, steps, 1.9 * sms, min_steps=4) if tiles < 1.5 * sms else 1
    return Plan(max(16, next_pow2(M)), block_n, split, swap=M <= 16 or wide or K > N, stages=6 if K > 2 * N else 4)


def w8a8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out: torch.Tensor, pdl: bool = False, p: Plan | None = None) -> torch.Tensor:
    """xq [M, K] FP8 with x_scale from quantize(), w [N, K] FP8 with w_scale -> out [M, N] (+ bias)."""
    M, K = xq.shape
    N = w.shape[0]
    group_of(w, w_scale)  # checks the scales' shape
    blocked = w_scale.shape[1] > 1  # a scale per 128-wide K step
    assert w.shape[1] == K and out.shape == (M, N) and out.stride(1) == 1 and w.stride(1) == 1
    if M == 0:
        return out
    if p is None:
        p = plan(M, N, K, sm_count(xq.device) if xq.is_cuda else 132)
        if out.dtype == torch.float32:
            p = replace(p, imprecise=0)
    k_per_split = cdiv(cdiv(K, GROUP), p.split) * GROUP
    split = cdiv(K, k_per_split)
    tiles = cdiv(M, p.block_m) * cdiv(N, p.block_n)
    part, counters = split_buffers(out, split, tiles)
    pdl = pdl and xq.is_cuda
    launch(_w8a8_kernel, (tiles, split), xq, x_scale, w, w_scale, bias if bias is not None else out, out, part,
           counters, M, N, K, k_per_split, split, xq.stride(0), x_scale.stride(0), w.stride(0), w_scale.stride(0),
           out.stride(0), BLOCKED=blocked, ROW_GROUP=1 if w_scale.shape[0] == N else GROUP, HAS_BIAS=bias is not None,
           NATIVE=xq.is_cuda, SPLIT_ONE=split == 1, SWAP=p.swap, IMPRECISE=p.imprecise,
           BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=GROUP, GROUP_M=8, PDL=pdl,
           num_warps=p.warps, num_stages=p.stages, launch_pdl=pdl)
    return out


CUBLAS_MIN_ROWS = 64  # more rows than this go to cuBLAS's FP8 GEMM where the scales allow


def cublas_scales(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor | None:
    """w_scale as torch._scaled_mm takes it for w.t() (row-wise [1, N], or 128 x 128 blocks
    [K/128, N/128]), None where cuBLAS can't (per-row block scales, partial blocks, sizes that are
    not multiples of 16): w8a8_matmul takes those."""
    N, K = w.shape
    if N % 16 or K % 16:  # cuBLASLt's FP8 GEMM
        return None
    if w_scale.shape[1] == 1 and w_scale.shape[0] == N:
        return w_scale.view(1, N)
    if w_scale.shape[0] == cdiv(N, GROUP) and N % GROUP == 0 and K % GROUP == 0:  # whole blocks only
        return w_scale.t()
    return None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (16-bit) @ the FP8 weight w [N, K].T (+ bias) -> [M, N] in x's dtype: x quantized
    by quantize(), then w8a8_matmul for few rows, cuBLAS's FP8 GEMM (float32 accumulation, row-wise
    or 128 x 128 block scales) for more: 1.3-4x w8a8_matmul's speed at 256-2,048 rows of Llama-3-8B's
    projections on an H200 (bench/NOTES.md, 2026-11-28). Same result as reference.fp8_linear."""
    M, K = x.shape
    N = w.shape[0]
    group = group_of(w, w_scale)
    b_scales = cublas_scales(w, w_scale) if x.is_cuda and M > CUBLAS_MIN_ROWS and x.dtype != torch.float32 else None
    if b_scales is None:
        if out is None:
            out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        xq, xs = quantize(x, group, pdl=pdl)
        return w8a8_matmul(xq, xs, w, w_scale, bias, out, pdl=pdl)
    xq, xs = quantize(x, group, scales_by_column=group == GROUP)
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=b_scales, out_dtype=x.dtype)
    if bias is not None:
        y += bias
    return y if out is None else out.copy_(y)


def fp8_gate_up_silu(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """The MLP's activation with an FP8 gate_up weight [2I, K]: silu(gate) * up [M, I] in x's dtype."""
    return silu_and_mul(fp8_linear(x, w, w_scale, pdl=pdl), pdl=pdl)
