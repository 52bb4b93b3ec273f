"""Sampled tokens in one kernel: temperature, top-k and top-p without sorting the vocabulary.

The torch path (engine/sampler.py) sorts every row to find the top-p nucleus: ~15 kernels over
[rows, vocabulary] floats, most of a small model's decode step (Qwen2.5-0.5B on an H100: a sampled
step took 2.08 ms against 1.36 greedy, bench/NOTES.md 2026-11-26). Here:

1. one pass, split over several programs a row (one program a row left half an H100's SMs idle
   at 64 rows, and this pass, with the noise of every logit, costs the most): each part's largest logit (and its
   first index), sum exp((l - m_part) / T), and its winner of the Gumbel race (argmax of
   l / T + Gumbel noise, which draws exactly from the softmax); then one program a row combines
   them into the row's largest logit m (its first index is the greedy token),
   Z = sum exp((l - m) / T) and the race's candidate c, and runs the rounds;
2. a round: one pass that counts the tokens above c and their probability mass. c is in the
   nucleus when fewer than top_k tokens and less than top_p of the mass lie above it: it is the
   sample. Otherwise every token at or below c is outside the nucleus too; the same pass has
   already raced the next round's candidate among the tokens above c. A draw that lands in the
   nucleus is distributed as the nucleus' renormalized probabilities (the race's winner among a
   subset, given it lies there); the top token is always accepted, so the rounds end. A round is
   rejected with probability < 1 - top_p, or about half the time under a small top_k, so a row
   takes 2 to ~15 passes over its logits, not a sort. Without a top_k the next race is left out
   of the round's pass (it is rarely needed: the noise, two logs a logit, is most of a pass's
   cost) and takes a pass of its own after a rejection.

Tokens of equal logits at the nucleus' edge are all kept (the sorted path keeps some of them, by
its sort order). The noise is Philox, keyed by a per-row seed and (round, token index): a row's draw
depends on its seed and logits only. A row with temperature 0 takes its greedy token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch

BLOCK = 4096
NUM_WARPS = 8
MAX_ROUNDS = 64  # never reached in practice (see above); past it the row takes its greedy token
PART_LOGITS = 16384  # logits a program of the first pass reads: 64 rows of 49,152 make 192 programs
MAX_PARTS = 16  # programs a row's first pass is split over, at most


@triton.jit
def _race(x, cols, allowed, inv_t, seed, rnd, V, best, cand):
    """The Gumbel race of round rnd over one block: (the best score so far, its token)."""
    u = tl.rand(seed, rnd * V + cols)
    g = -tl.log(-tl.log(u))  # Gumbel(0, 1); u = 0 gives -inf: never drawn
    s = tl.where(allowed, x * inv_t + g, float("-inf"))
    bs = tl.max(s, axis=0)
    bi = tl.min(tl.where(s == bs, cols, V), axis=0)
    return tl.maximum(best, bs), tl.where(bs > best, bi, cand)


@triton.jit
def _first_pass_kernel(x_ptr, stride_x, temps_ptr, seeds_ptr, part_f_ptr, part_i_ptr, V, span,
                       BLOCK: tl.constexpr):
    """Part p of a row, logits [p * span, (p + 1) * span): its largest logit and first index; for a
    sampled row also sum exp((l - m_part) / T) and the race's best score and token (round 0)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    lo = part * span
    hi = tl.minimum(lo + span, V)
    temp = tl.load(temps_ptr + row)
    m = float("-inf")
    first = V
    z = 0.0
    best = float("-inf")
    cand = V
    if temp > 0:
        inv_t = 1.0 / temp
        seed = tl.load(seeds_ptr + row)
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, axis=0)
            bi = tl.min(tl.where(x == bm, cols, V), axis=0)
            new_m = tl.maximum(m, bm)
            first = tl.where(bm > m, bi, first)
            # (a part of -inf logits keeps z = 0: exp of -inf - -inf would be NaN)
            z = tl.where(new_m > float("-inf"),
                         z * tl.exp((m - new_m) * inv_t) + tl.sum(tl.exp((x - new_m) * inv_t), axis=0), 0.0)
            m = new_m
            best, cand = _race(x, cols, cols < hi, inv_t, seed, 0, V, best, cand)
    else:
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, axis=0)
            bi = tl.min(tl.where(x == bm, cols, V), axis=0)
            first = tl.where(bm > m, bi, first)
            m = tl.maximum(m, bm)
    at = row * parts + part
    tl.store(part_f_ptr + at * 3, m)
    tl.store(part_f_ptr + at * 3 + 1, z)
    tl.store(part_f_ptr + at * 3 + 2, best)
    tl.store(part_i_ptr + at * 2, first)
    tl.store(part_i_ptr + at * 2 + 1, cand)


@triton.jit
def _sample_kernel(x_ptr, stride_x, temps_ptr, top_k_ptr, top_p_ptr, seeds_ptr, part_f_ptr, part_i_ptr, out_ptr,
                   V, parts, BLOCK: tl.constexpr, MAX_PARTS: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    # the parts, in index order: the first part holding the largest logit holds its first index,
    # and a tie of race scores goes to the smaller token, as in one pass over the row
    ps = tl.arange(0, MAX_PARTS)
    at = row * parts + ps
    pm = ps < parts
    mp = tl.load(part_f_ptr + at * 3, mask=pm, other=float("-inf"))
    m = tl.max(mp, axis=0)
    first = tl.min(tl.where(pm & (mp == m), tl.load(part_i_ptr + at * 2, mask=pm, other=V), V), axis=0)
    first = tl.where(first < V, first, 0)  # a row of -inf logits
    token = first
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        inv_t = 1.0 / temp
        seed = tl.load(seeds_ptr + row)
        zp = tl.load(part_f_ptr + at * 3 + 1, mask=pm, other=0.0)
        z = tl.sum(tl.where(mp > float("-inf"), zp * tl.exp((mp - m) * inv_t), 0.0), axis=0)
        bp = tl.load(part_f_ptr + at * 3 + 2, mask=pm, other=float("-inf"))
        best = tl.max(bp, axis=0)
        cand = tl.min(tl.where(pm & (bp == best), tl.load(part_i_ptr + at * 2 + 1, mask=pm, other=V), V), axis=0)
        cand = tl.where(cand < V, cand, first)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        # with top_p alone a candidate is accepted with probability >= top_p (the nucleus holds that
        # much of the mass): the next round's race waits for a rejection, in a pass of its own. A
        # top_k rejects about half the time: its rounds race the next candidate in the same pass.
        fused = top_k < V
        # nothing to cut (temperature only): the race's winner is the draw, no round needed
        done = ((top_k >= V) & (top_p >= 1.0)).to(tl.int32)
        token = tl.where(done == 1, cand, token)
        rnd = tl.full([], 0, tl.int32)
        # a round: one pass that weighs the candidate (the tokens and mass above it) and, if it is
        # rejected, the race of the next round among the tokens above it (same noise either way)
        while (done == 0) & (rnd < MAX_ROUNDS):
            lc = tl.load(base + cand).to(tl.float32)
            above = 0
            mass = 0.0
            best = float("-inf")
            nxt = first
            for start in range(0, V, BLOCK):
                cols = start + offs
                x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                up = x > lc
                above += tl.sum(up.to(tl.int32), axis=0)
                mass += tl.sum(tl.where(up, tl.exp((x - m) * inv_t), 0.0), axis=0)
                if fused:
                    best, nxt = _race(x, cols, up & (cols < V), inv_t, seed, rnd + 1, V, best, nxt)
            ok = (above < top_k) & ((mass < top_p * z) | (top_p >= 1.0))
            token = tl.where(ok, cand, token)
            if (fused == 0) & (ok == 0):
                for start in range(0, V, BLOCK):
                    cols = start + offs
                    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
                    best, nxt = _race(x, cols, (x > lc) & (cols < V), inv_t, seed, rnd + 1, V, best, nxt)
            # nothing above the candidate: cannot happen (the top token is accepted)
            done = (ok | (best == float("-inf"))).to(tl.int32)
            cand = nxt
            rnd += 1
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(x: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK,
                num_warps: int = NUM_WARPS, parts: int | None = None) -> torch.Tensor:
    """x [N, V] logits (16- or 32-bit float, rows contiguous); per row: temps float32 (0: greedy),
    top_k int32 (V or more: off), top_p float32 (1: off), seeds int64 (the noise's key) -> int64 [N]
    token ids drawn from softmax(x / T) restricted to the top-k and top-p nucleus. block: logits a
    program reads at once (a power of two); num_warps: its warps (lab/sampling.py sweeps both);
    parts: programs a row's first pass is split over (default: one per PART_LOGITS logits)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    N, V = x.shape
    assert 0 < V and V * (MAX_ROUNDS + 1) < 2**31
    for t, dtype in ((temps, torch.float32), (top_k, torch.int32), (top_p, torch.float32), (seeds, torch.int64)):
        assert t.shape == (N,) and t.dtype == dtype and t.is_contiguous() and t.device == x.device
    if out is None:
        out = torch.empty(N, dtype=torch.int64, device=x.device)
    assert out.shape == (N,) and out.dtype == torch.int64 and out.is_contiguous()
    if not N:
        return out
    block = min(block, triton.next_power_of_2(V))
    if parts is None:  # by the vocabulary alone: a row's Z, summed by parts, is the same in any batch
        parts = triton.cdiv(V, PART_LOGITS)
    parts = max(1, min(parts, MAX_PARTS, triton.cdiv(V, block)))
    span = triton.cdiv(triton.cdiv(V, parts), block) * block  # whole blocks a part
    parts = triton.cdiv(V, span)
    part_f = torch.empty((N, parts, 3), dtype=torch.float32, device=x.device)
    part_i = torch.empty((N, parts, 2), dtype=torch.int32, device=x.device)
    launch(_first_pass_kernel, (N, parts), x, x.stride(0), temps, seeds, part_f, part_i, V, span,
           BLOCK=block, num_warps=num_warps)
    launch(_sample_kernel, (N,), x, x.stride(0), temps, top_k, top_p, seeds, part_f, part_i, out, V, parts,
           BLOCK=block, MAX_PARTS=MAX_PARTS, MAX_ROUNDS=MAX_ROUNDS, num_warps=num_warps)
    return out
