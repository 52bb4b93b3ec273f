"""A persistent TMA matmul (Hopper), y = x @ w.T, to measure against cuBLAS at a mixed step's row
counts (lab/forward_curve.py --triton). One program per SM walks the output tiles, the M tiles of
one weight tile next to each other so that the SMs working at the same time share its read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import TensorDescriptor

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
CANDIDATES = [(64, 128, 64, 4, 4), (64, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 256, 64, 3, 8),
              (128, 64, 64, 4, 4), (64, 64, 128, 4, 4)]


@triton.jit
def _persistent_mm(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   NUM_SMS: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_tiles = num_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in range(tl.program_id(0), num_tiles, NUM_SMS):
        pid_m = tile % num_m
        pid_n = tile // num_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


def matmul(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int, int],
           programs: int | None = None) -> torch.Tensor:
    """programs: at most this many programs (SMs) instead of one an SM (lab/overlap_probe.py leaves
    the others to a kernel on another stream)."""
    assert x.dtype == w.dtype == torch.bfloat16 and x.shape[1] == w.shape[1]
    bm, bn, bk, stages, warps = tiles
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    sms = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    a = TensorDescriptor.from_tensor(x, [bm, bk])
    b = TensorDescriptor.from_tensor(w, [bn, bk])
    c = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _persistent_mm[grid](a, b, c, M, N, K, BM=bm, BN=bn, BK=bk, NUM_SMS=sms, num_stages=stages, num_warps=warps)
    return out
