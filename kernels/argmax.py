"""Greedy tokens: the index of each row's largest logit, the first one among equals (as torch.argmax).

torch's reduction gives each row of the [batch, vocab] logits to one block: for a decode batch of
64 rows over Qwen2.5-0.5B's 151,936-entry vocabulary it took 22.7 us of a 1.28 ms decode step on an
H100 (bench/NOTES.md, 2026-11-23), where reading the 19 MB is ~6 us. Here a row is cut into
chunks of CHUNK logits, one program each; every program stores its chunk's largest value and the
first index holding it (NaN counting as the largest, as in torch), and the last program of a row to arrive (a per-row counter, as in
kernels/linear.py) picks the first chunk holding the row's largest value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import arrival_counters, cdiv, launch, next_pow2

CHUNK = 4096


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, pmax_ptr, pidx_ptr, count_ptr, V, stride_x, chunks,
                   CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    # as torch: a NaN is larger than everything. A chunk with one reports its first NaN (value NaN)
    nan_idx = tl.min(tl.where(x != x, cols, V), axis=0)
    best = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
    # the first column holding the chunk's max (masked columns, >= V, are never the first)
    idx = tl.min(tl.where(x == best, cols, V), axis=0)
    tl.store(pmax_ptr + row * chunks + c, tl.where(nan_idx < V, float("nan"), best))
    tl.store(pidx_ptr + row * chunks + c, tl.where(nan_idx < V, nan_idx, idx))
    tl.debug_barrier()  # the partials are stored before the count goes up
    arrived = tl.atomic_add(count_ptr + row, 1)  # acq_rel: the last arrival sees every partial
    if arrived == chunks - 1:
        s = tl.arange(0, BLOCK_C)
        smask = s < chunks
        m = tl.load(pmax_ptr + row * chunks + s, mask=smask, other=float("-inf"), cache_modifier=".cg")
        i = tl.load(pidx_ptr + row * chunks + s, mask=smask, other=V, cache_modifier=".cg")
        first_nan = tl.min(tl.where(m != m, i, V), axis=0)
        top = tl.max(tl.where(m != m, float("-inf"), m), axis=0)
        # chunks are in column order: the smallest index among the chunks holding the max is the first
        first_max = tl.min(tl.where(m == top, i, V), axis=0)
        tl.store(out_ptr + row, tl.where(first_nan < V, first_nan, first_max).to(tl.int64))
        tl.store(count_ptr + row, 0)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """x [N, V] (16- or 32-bit float, rows contiguous) -> int64 [N], the first index of each row's
    maximum, NaN above all (torch.argmax(x, dim=-1)). chunk: logits per program (a power of two)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    N, V = x.shape
    assert V > 0 and V < 2**31
    if out is None:
        out = torch.empty(N, dtype=torch.int64, device=x.device)
    assert out.shape == (N,) and out.dtype == torch.int64 and out.is_contiguous()
    if N == 0:
        return out
    assert chunk & (chunk - 1) == 0
    chunks = cdiv(V, chunk)
    pmax = torch.empty((N, chunks), dtype=torch.float32, device=x.device)
    pidx = torch.empty((N, chunks), dtype=torch.int32, device=x.device)
    launch(_argmax_kernel, (N, chunks), x, out, pmax, pidx, arrival_counters(x.device, N), V, x.stride(0), chunks,
           CHUNK=chunk, BLOCK_C=max(2, next_pow2(chunks)), num_warps=8)
    return out
