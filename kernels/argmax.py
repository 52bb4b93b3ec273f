"""Greedy tokens: the index of each row's largest logit, the first one among equals (as torch.argmax).

torch's reduction gives each row of the [batch, vocab] logits to one block: for a decode batch of
64 rows over Qwen2.5-0.5B's 151,936-entry vocabulary it took 22.7 us of a 1.28 ms decode step on an
H100 (bench/NOTES.md, 2026-11-23), where reading the 19 MB is ~6 us. Here a row is cut into
chunks of CHUNK logits, one program each; every program stores its chunk's largest value and the
first index holding it (NaN counting as the largest, as in torch), and the last program of a row to arrive (a per-row counter, as in
kernels/linear.py) picks the first chunk holding the row's largest value.

Under tensor parallelism each rank holds the logits of its own range of the vocabulary. Rather than
gathering them all (an all-gather of [batch, vocab] and a copy into row order, ~41 us of a 4.6 ms
Llama-3-8B decode step at TP=2), argmax_keys gives each row's best as one int64 that orders as
(value, then the lower index) does: the largest over the ranks (an all-reduce MAX of [batch] int64)
is the greedy token of the whole vocabulary, the same one argmax_rows would pick from the gathered
row (key_token reads it back).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import arrival_counters, cdiv, launch, next_pow2

CHUNK = 4096
KEY_INDEX_BITS = 32  # a key's low bits: 2**32 - 1 - index, so that among equal values the lower index wins


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, pmax_ptr, pidx_ptr, count_ptr, V, stride_x, chunks, offset,
                   CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, KEY: tl.constexpr):
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
        token = tl.where(first_nan < V, first_nan, first_max).to(tl.int64)
        if KEY:
            # float32 bits as an int32 that orders as the floats do (a negative one's magnitude bits
            # flipped; -0.0 made +0.0 first: they are equal), NaN above +inf
            bits = (top + 0.0).to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            ordered = tl.where(first_nan < V, 0x7FFFFFFF, ordered)
            token = (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - (token + offset))
        tl.store(out_ptr + row, token)
        tl.store(count_ptr + row, 0)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """x [N, V] (16- or 32-bit float, rows contiguous) -> int64 [N], the first index of each row's
    maximum, NaN above all (torch.argmax(x, dim=-1)). chunk: logits per program (a power of two)."""
    return _argmax(x, out, chunk, None)


def argmax_keys(x: torch.Tensor, offset: int, out: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """x [N, V] as for argmax_rows, the logits of vocabulary entries offset .. offset + V - 1 ->
    int64 [N] keys: the larger of two keys is the row's argmax over both ranges (the lower index
    among equal values); key_token(key) is that index."""
    return _argmax(x, out, chunk, offset)


def key_token(keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The vocabulary index an argmax_keys key holds."""
    low = keys & (2**KEY_INDEX_BITS - 1)
    return torch.sub(2**KEY_INDEX_BITS - 1, low, out=out)


def _argmax(x: torch.Tensor, out: torch.Tensor | None, chunk: int, offset: int | None) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    N, V = x.shape
    assert V > 0 and V < 2**31 and (offset is None or 0 <= offset < 2**31 - V)
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
           offset or 0, CHUNK=chunk, BLOCK_C=max(2, next_pow2(chunks)), KEY=offset is not None, num_warps=8)
    return out
