"""A split-K TMA matmul (Hopper), y = x @ w.T, for the projections whose output tiles at 128-512
rows are too few for the GPU's SMs: `lab/mid_gemm.py --triton` times it against cuBLAS.

At 256 rows Llama-3-8B's o and down projections have 64 output tiles of 128 x 128 for 132 SMs
and cuBLAS runs them at 2.2x and 1.6x their max(compute, memory) (bench/NOTES.md, 2026-11-27);
its split-K through torch (a batched GEMM with float32 outputs, summed after it) was slower still.
Here each output tile's K is cut into SPLIT parts, one program each, next to each other in the
grid (and the M tiles of one weight tile next to each other, so the programs running at once share
its read from L2). With SPLIT > 1 a program stores its float32 partial and counts its arrival on
the tile's counter; the last to arrive adds the partials in split order (the result does not depend
on timing, as kernels/linear.py's skinny kernel) and stores the tile.

Measured in CUDA graphs on an H100 (2026-11-27, bench/NOTES.md): slower than cuBLAS at all 36
shapes (Llama-3-8B and 70B TP=2 projections, 128-640 rows); its best plans were mostly unsplit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attn_common import mma
from kernels.launch import TensorDescriptor, arrival_counters, launch

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, stages, warps)
CANDIDATES = [(128, 128, 64, 1, 4, 8), (128, 128, 64, 2, 4, 8), (128, 128, 64, 3, 4, 8), (128, 128, 64, 4, 4, 8),
              (64, 128, 64, 2, 4, 4), (128, 64, 64, 1, 4, 4), (128, 64, 64, 2, 4, 4), (128, 64, 64, 4, 4, 4),
              (128, 256, 64, 1, 3, 8), (128, 256, 64, 2, 3, 8), (128, 256, 64, 4, 3, 8), (64, 256, 64, 2, 3, 8),
              (256, 128, 64, 1, 3, 8), (256, 128, 64, 2, 3, 8),
              # small models' long-K projections into few columns (Qwen2.5-0.5B's down: N 896, K 4,864)
              (64, 128, 64, 4, 4, 4), (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 4, 8), (64, 64, 64, 8, 4, 4)]


@triton.jit
def _splitk_mm(a_desc, b_desc, out_ptr, part_ptr, count_ptr, M, N, K, stride_om,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // SPLIT
    s = pid % SPLIT
    num_m = tl.cdiv(M, BM)
    pid_m = tile % num_m
    pid_n = tile // num_m
    k_tiles = tl.cdiv(K, BK)
    per = tl.cdiv(k_tiles, SPLIT)
    k_lo = s * per
    k_hi = tl.minimum(k_lo + per, k_tiles)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        a = a_desc.load([pid_m * BM, ki * BK])
        b = b_desc.load([pid_n * BN, ki * BK])
        acc += mma(a, b.T, NATIVE)  # NATIVE: on the GPU (the interpreter's bf16 dot is wrong)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        local = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tiles = tl.num_programs(0) // SPLIT
        tl.store(part_ptr + (s * tiles + tile).to(tl.int64) * (BM * BN) + local, acc)
        tl.debug_barrier()  # every thread's partial is stored before the count goes up
        arrived = tl.atomic_add(count_ptr + tile, 1)  # acq_rel: the last arrival sees every partial
        if arrived == SPLIT - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for i in range(0, SPLIT):
                total += tl.load(part_ptr + (i * tiles + tile).to(tl.int64) * (BM * BN) + local, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(count_ptr + tile, 0)


def matmul(x: torch.Tensor, w: torch.Tensor, plan: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype; plan: one of CANDIDATES."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.dtype == w.dtype
    assert x.is_contiguous() and w.is_contiguous()
    bm, bn, bk, split, stages, warps = plan
    M, K = x.shape
    N = w.shape[0]
    assert K % bk == 0 and triton.cdiv(K // bk, split) * (split - 1) < K // bk, "every split needs K"
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    part = torch.empty((split * tiles * bm * bn) if split > 1 else 1, dtype=torch.float32, device=x.device)
    launch(_splitk_mm, (tiles * split,), TensorDescriptor.from_tensor(x, [bm, bk]),
           TensorDescriptor.from_tensor(w, [bn, bk]), out, part, arrival_counters(x.device, tiles), M, N, K,
           out.stride(0), BM=bm, BN=bn, BK=bk, SPLIT=split, NATIVE=x.is_cuda, num_stages=stages, num_warps=warps)
    return out
