"""A decode step's MLP block in one persistent kernel, for up to 64 rows of a small model:
residual add + RMSNorm, gate/up with SiLU-and-multiply, and the down projection, one program per SM
with a grid-wide barrier between the two matmuls. `python -m lab.persistent_mlp_bench` times it
against the engine's three kernels (kernels/fused.py's add + RMSNorm, kernels/gate_up.py,
kernels/linear.py's skinny down projection).

Measured on an H100 (bench/NOTES.md, 2026-11-27): correct, and 1.2-2.1x slower than the three
kernels at Qwen2.5-0.5B's and SmolLM2-135M's shapes. The barrier costs nothing measurable (the
kernel takes what its two phases take as two launches); the phases themselves are slower than the
kernels they replace, because a program per SM of 4-8 warps issues an instruction every ~8 cycles
(ncu: one warp per scheduler, stalls on shared memory), and phase A repeats the add and norm's
elementwise work over all of x in every program. Not used by the engine.

- Phase A: program p owns a contiguous run of the I gate columns and their up columns. It reads
  x + residual (rounded to the dtype, as the reference adds them; programs p, p + P, ... store the
  sum as the next residual), multiplies x * norm_weight with its gate and up rows while it sums
  x^2, and scales the two products by each row's 1/rms afterwards: RMSNorm is linear per row, so
  no program waits for the rows' norms before its matmul. The product differs from the reference's
  (which rounds the normed x before the matmul) by the rounding of that one scale. With
  Plan.norm False, x comes in normed (the pure matmul, for timing).
- Barrier: every program adds one to a counter and spins until all have (they are co-resident:
  one a SM, launched after the kernel before has finished).
- Phase B: program p owns one (column tile, K split) of the down projection over the activations
  of phase A (read past L1, which is not coherent); the programs of a column tile write float32
  partials and the last to arrive sums them in split order (the result does not depend on timing)
  and stores the output. The down weights are asked into L2 at the start of phase A.

The counters are zero between launches: the last program through phase B resets the barrier.
Under Triton's CPU interpreter programs run one after another, so a spin would never end there:
the wrapper launches phase A and phase B as two grids instead (the same code, ordered by the
launches).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.attn_common import mma
from kernels.launch import arrival_counters, cdiv, launch, next_pow2, sm_count
from kernels.pdl import prefetch_l2

MAX_M = 64
# MLPs whose weights stream in a few microseconds; larger ones (Llama-3-8B's 352 MB) are
# bandwidth-bound matmuls that cuBLAS runs near the copy bandwidth already
MAX_WEIGHT_BYTES = 64 << 20


@triton.jit
def _phase_a(h_ptr, r_ptr, nw_ptr, wgu_ptr, act_ptr, res_ptr, wd_ptr, pid, programs, M, H, I, eps,
             stride_h, stride_r, stride_w, stride_a, stride_res, stride_wd, cols, d_tile, d_k_lo, d_k_hi,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             D_BLOCK_N: tl.constexpr, D_LINES: tl.constexpr, NATIVE: tl.constexpr, NORM: tl.constexpr):
    dt = h_ptr.dtype.element_ty
    if D_LINES > 0:
        # this program's down-projection weights into L2 while phase A streams gate/up
        d_rows = tl.minimum(d_tile * D_BLOCK_N + tl.arange(0, D_BLOCK_N), H - 1).to(tl.int64)
        lines = tl.minimum(d_k_lo + tl.arange(0, D_LINES) * 64, d_k_hi - 1)
        prefetch_l2(wd_ptr + d_rows[:, None] * stride_wd + lines[None, :])
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    c0 = pid * cols
    offs_n = c0 + tl.arange(0, BLOCK_N)
    n_mask = (tl.arange(0, BLOCK_N) < cols) & (offs_n < I)
    gate_rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    steps = tl.cdiv(H, BLOCK_K)
    for i in range(0, steps):
        # every program reads all of x, each from another K block at a time (timed both ways: the
        # same, bench/NOTES.md 2026-11-27)
        kb = (i + pid) % steps
        ks = kb * BLOCK_K + offs_k
        k_mask = ks < H
        x_mask = m_mask[:, None] & k_mask[None, :]
        hx = tl.load(h_ptr + offs_m[:, None] * stride_h + ks[None, :], mask=x_mask, other=0.0)
        if NORM:
            rx = tl.load(r_ptr + offs_m[:, None] * stride_r + ks[None, :], mask=x_mask, other=0.0)
            x = (hx.to(tl.float32) + rx.to(tl.float32)).to(dt)
            if kb % programs == pid:
                tl.store(res_ptr + offs_m[:, None] * stride_res + ks[None, :], x, mask=x_mask)
            xf = x.to(tl.float32)
            sumsq += xf * xf
            nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            xw = (xf * nw[None, :]).to(dt)
        else:
            xw = hx
        w_mask = n_mask[:, None] & k_mask[None, :]
        g = tl.load(wgu_ptr + gate_rows[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        u = tl.load(wgu_ptr + (gate_rows + I)[:, None] * stride_w + ks[None, :], mask=w_mask, other=0.0)
        acc_g += mma(xw, tl.trans(g), NATIVE)
        acc_u += mma(xw, tl.trans(u), NATIVE)
    if NORM:
        rs = tl.math.rsqrt(tl.sum(sumsq, axis=1) / H + eps)
        acc_g = acc_g * rs[:, None]
        acc_u = acc_u * rs[:, None]
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(act_ptr + offs_m[:, None] * stride_a + offs_n[None, :], (act * up).to(dt),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _grid_barrier(sync_ptr, programs, SPIN: tl.constexpr):
    """Every program's stores before it are visible to every program after it."""
    tl.debug_barrier()
    seen = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu") + 1
    if SPIN == 1:
        # plain loads while waiting (no read-modify-writes queueing at the counter's L2 slice), one
        # acquire once all have arrived
        while seen < programs:
            seen = tl.load(sync_ptr, volatile=True)
        tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    else:
        while seen < programs:
            seen = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _phase_b(act_ptr, wd_ptr, part_ptr, count_ptr, out_ptr, M, H, I, stride_a, stride_wd, stride_o,
             tile, split, splits, k_lo, k_hi,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = tl.cdiv(k_hi - k_lo, BLOCK_K)
    for i in range(0, steps):
        # the column tiles of a split read the same activations, from different blocks at a time
        ks = k_lo + ((i + tile) % steps) * BLOCK_K + offs_k
        k_mask = ks < k_hi
        a = tl.load(act_ptr + offs_m[:, None] * stride_a + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0, cache_modifier=".cg")
        w = tl.load(wd_ptr + offs_n[:, None].to(tl.int64) * stride_wd + ks[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += mma(a, tl.trans(w), NATIVE)
    tile_off = offs_m[:, None] * H + offs_n[None, :]
    tile_mask = m_mask[:, None] & n_mask[None, :]
    dt = out_ptr.dtype.element_ty
    if splits == 1:
        tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], acc.to(dt), mask=tile_mask)
    else:
        tl.store(part_ptr + split * M * H + tile_off, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial is stored before the count goes up
        arrived = tl.atomic_add(count_ptr + tile, 1)  # acq_rel
        if arrived == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(part_ptr + s * M * H + tile_off, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], total.to(dt), mask=tile_mask)


# M changes with every eager step's batch: no specialization on it
@triton.jit(do_not_specialize=["M"])
def _mlp_kernel(h_ptr, r_ptr, nw_ptr, wgu_ptr, wd_ptr, act_ptr, part_ptr, count_ptr, sync_ptr, out_ptr, res_ptr,
                M, H, I, eps, stride_h, stride_r, stride_w, stride_wd, stride_a, stride_o, stride_res,
                cols, splits, k_per_split,
                PHASE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                D_BLOCK_N: tl.constexpr, D_BLOCK_K: tl.constexpr, D_LINES: tl.constexpr, NATIVE: tl.constexpr,
                SPIN: tl.constexpr, NORM: tl.constexpr):
    # PHASE 0: A, barrier, B (the GPU); 1: A only; 2: B only (the interpreter's two launches)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = tl.cdiv(H, D_BLOCK_N)
    work_b = pid < tiles * splits
    tile = pid // splits
    split = pid % splits
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, I)
    if PHASE != 2:
        _phase_a(h_ptr, r_ptr, nw_ptr, wgu_ptr, act_ptr, res_ptr, wd_ptr, pid, programs, M, H, I, eps,
                 stride_h, stride_r, stride_w, stride_a, stride_res, stride_wd, cols, tile, k_lo, k_hi,
                 BLOCK_M, BLOCK_N, BLOCK_K, D_BLOCK_N, D_LINES if PHASE == 0 else 0, NATIVE, NORM)
    if PHASE == 0:
        _grid_barrier(sync_ptr, programs, SPIN)
    if PHASE != 1:
        if work_b:
            _phase_b(act_ptr, wd_ptr, part_ptr, count_ptr, out_ptr, M, H, I, stride_a, stride_wd, stride_o,
                     tile, split, splits, k_lo, k_hi, BLOCK_M, D_BLOCK_N, D_BLOCK_K, NATIVE)
    if PHASE == 0:
        # the last program out resets the barrier: every program has passed its spin by then
        left = tl.atomic_add(sync_ptr + 1, 1)
        if left == programs - 1:
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)


@dataclass(frozen=True)
class Plan:
    programs: int  # one a SM
    block_n: int  # phase A: columns of gate (and of up) a program owns, rounded up to a power of two
    block_k: int
    d_block_n: int  # phase B: the down projection's column tile and K split
    d_block_k: int
    splits: int
    num_warps: int = 8
    num_stages: int = 3
    prefetch: bool = True
    spin: int = 1
    norm: bool = True  # False: x comes in normed (residual and norm weight unused): the matmuls alone


def plan(M: int, H: int, I: int, programs: int, d_block_n: int = 64) -> Plan:
    """Phase A: the I gate columns spread evenly over the programs. Phase B: column tiles of the
    hidden size (wider where there would be more tiles than programs) times as many K splits as
    fit the programs."""
    cols = cdiv(I, programs)
    block_k = 128 if H % 128 == 0 else 64
    while cdiv(H, d_block_n) > programs:
        d_block_n *= 2
    tiles = cdiv(H, d_block_n)
    splits = max(1, programs // tiles)
    return Plan(programs, max(16, next_pow2(cols)), block_k, d_block_n, 64, splits)


def supports(x: torch.Tensor, residual: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether fused_mlp takes these: 16-bit rows of a decode step (M <= 64), weights of a small MLP,
    rows contiguous."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.dtype in (torch.bfloat16, torch.float16)
            and residual.shape == x.shape and residual.dtype == x.dtype
            and w_gate_up.dtype == x.dtype and w_down.dtype == x.dtype
            and w_gate_up.shape[1] == x.shape[1] and w_down.shape == (x.shape[1], w_gate_up.shape[0] // 2)
            and x.stride(1) == 1 and residual.stride(1) == 1 and w_gate_up.stride(1) == 1 and w_down.stride(1) == 1
            and (w_gate_up.numel() + w_down.numel()) * x.element_size() <= MAX_WEIGHT_BYTES)


def _programs(device: torch.device) -> int:
    # the interpreter: a few programs, so the tests cover several owners of each phase
    return sm_count(device) if device.type == "cuda" else 4


def fused_mlp(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              w_gate_up: torch.Tensor, w_down: torch.Tensor, p: Plan | None = None,
              phases: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mlp(rms_norm(x + residual)), x + residual) for x, residual [M, H], w_gate_up [2I, H] (gate
    rows, then up rows), w_down [H, I]; the same as reference_mlp within the rounding of the norm's
    scale (module docstring). phases: the launches' PHASE values, (0,) on a GPU, (1, 2) under the
    interpreter; lab/persistent_mlp_bench.py times (1,) and (2,) alone."""
    assert supports(x, residual, w_gate_up, w_down), "fused_mlp needs 16-bit decode rows and a small MLP"
    M, H = x.shape
    I = w_gate_up.shape[0] // 2
    assert norm_weight.shape == (H,) and norm_weight.is_contiguous()
    p = p or plan(M, H, I, _programs(x.device))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res = torch.empty_like(x, memory_format=torch.contiguous_format)
    act = torch.empty((M, I), dtype=x.dtype, device=x.device)
    tiles = cdiv(H, p.d_block_n)
    k_per_split = cdiv(cdiv(I, p.d_block_k), p.splits) * p.d_block_k
    splits = cdiv(I, k_per_split)
    assert tiles * splits <= p.programs
    part = torch.empty((splits, M, H), dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = arrival_counters(x.device, tiles + 2)
    sync, count = counters[:2], counters[2:]
    interpret = os.environ.get("TRITON_INTERPRET") == "1" or not x.is_cuda
    lines = min(128, next_pow2(cdiv(k_per_split, 64))) if p.prefetch and not interpret else 0
    args = (x, residual, norm_weight, w_gate_up, w_down, act, part, count, sync, out, res,
            M, H, I, eps, x.stride(0), residual.stride(0), w_gate_up.stride(0), w_down.stride(0),
            act.stride(0), out.stride(0), res.stride(0), cdiv(I, p.programs), splits, k_per_split)
    meta = dict(BLOCK_M=max(16, next_pow2(M)), BLOCK_N=p.block_n, BLOCK_K=p.block_k, D_BLOCK_N=p.d_block_n,
                D_BLOCK_K=p.d_block_k, D_LINES=lines, NATIVE=x.is_cuda, SPIN=p.spin, NORM=p.norm,
                num_warps=p.num_warps, num_stages=p.num_stages)
    for phase in phases or ((1, 2) if interpret else (0,)):
        launch(_mlp_kernel, (p.programs,), *args, PHASE=phase, **meta)
    return out, res


def reference_mlp(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused block fused_mlp stands for."""
    normed, res = reference.rms_norm(x, norm_weight, eps, residual)
    return reference.linear(reference.gate_up_silu(normed, w_gate_up), w_down), res
