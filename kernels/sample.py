"""Sampled tokens in one kernel: temperature, top-k and top-p without sorting the vocabulary.

The torch path (engine/sampler.py) sorts every row to find the top-p nucleus: ~15 kernels over
[rows, vocabulary] floats, most of a small model's decode step (Qwen2.5-0.5B on an H100: a sampled
step took 2.08 ms against 1.36 greedy, bench/NOTES.md 2026-11-26). Here one program takes a row:

1. one pass: the row's largest logit m (and its first index, the greedy token),
   Z = sum exp((l - m) / T), and a candidate c by the Gumbel race (argmax of l / T + Gumbel noise,
   which draws exactly from the softmax);
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
def _sample_kernel(x_ptr, stride_x, temps_ptr, top_k_ptr, top_p_ptr, seeds_ptr, out_ptr, V,
                   BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    temp = tl.load(temps_ptr + row)
    if temp > 0:
        inv_t = 1.0 / temp
        seed = tl.load(seeds_ptr + row)
        # one pass: the largest logit m and its first index, Z = sum exp((l - m) / T) (rescaled as
        # m grows), and round 0's candidate (the race needs neither m nor Z)
        m = float("-inf")
        first = 0
        z = 0.0
        best = float("-inf")
        cand = 0
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, axis=0)
            bi = tl.min(tl.where(x == bm, cols, V), axis=0)
            new_m = tl.maximum(m, bm)
            first = tl.where(bm > m, bi, first)
            z = z * tl.exp((m - new_m) * inv_t) + tl.sum(tl.exp((x - new_m) * inv_t), axis=0)
            m = new_m
            best, cand = _race(x, cols, cols < V, inv_t, seed, 0, V, best, cand)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        # with top_p alone a candidate is accepted with probability >= top_p (the nucleus holds that
        # much of the mass): the next round's race waits for a rejection, in a pass of its own. A
        # top_k rejects about half the time: its rounds race the next candidate in the same pass.
        fused = top_k < V
        token = first
        done = tl.full([], 0, tl.int32)
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
            done = (ok | (best == float("-inf"))).to(tl.int32)  # nothing above: cannot happen (the top token is accepted)
            cand = nxt
            rnd += 1
    else:  # greedy: the first largest logit
        token = 0
        m = float("-inf")
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, axis=0)
            bi = tl.min(tl.where(x == bm, cols, V), axis=0)
            token = tl.where(bm > m, bi, token)
            m = tl.maximum(m, bm)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(x: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, out: torch.Tensor | None = None, block: int = BLOCK,
                num_warps: int = NUM_WARPS) -> torch.Tensor:
    """x [N, V] logits (16- or 32-bit float, rows contiguous); per row: temps float32 (0: greedy),
    top_k int32 (V or more: off), top_p float32 (1: off), seeds int64 (the noise's key) -> int64 [N]
    token ids drawn from softmax(x / T) restricted to the top-k and top-p nucleus. block: logits a
    program reads at once (a power of two); num_warps: its warps (lab/sampling.py sweeps both)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    N, V = x.shape
    assert 0 < V and V * (MAX_ROUNDS + 1) < 2**31
    for t, dtype in ((temps, torch.float32), (top_k, torch.int32), (top_p, torch.float32), (seeds, torch.int64)):
        assert t.shape == (N,) and t.dtype == dtype and t.is_contiguous() and t.device == x.device
    if out is None:
        out = torch.empty(N, dtype=torch.int64, device=x.device)
    assert out.shape == (N,) and out.dtype == torch.int64 and out.is_contiguous()
    if N:
        launch(_sample_kernel, (N,), x, x.stride(0), temps, top_k, top_p, seeds, out, V,
               BLOCK=min(block, triton.next_power_of_2(V)), MAX_ROUNDS=MAX_ROUNDS, num_warps=num_warps)
    return out
