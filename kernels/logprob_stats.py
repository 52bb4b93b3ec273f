"""Per row of logits: the log-sum-exp, one chosen token's logit and its rank (1 + how many tokens
score higher), in one pass over the row in its own dtype (prompt logprobs, engine/prompt_logprobs.py).
In torch the same is a float32 copy of the rows, a log-softmax, a gather, a compare and a sum: five
passes over [rows, vocabulary] for every prompt token scored.

The exponentials are summed online per lane (the running maximum of each lane), lanes combined at
the end; the sum's order differs from torch's, so the log-sum-exp agrees to float32 rounding
(reference.logprob_stats).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch

BLOCK = 2048


# targets: slices of one upload (engine/prompt_logprobs.py), at any alignment: one compile
@triton.jit(do_not_specialize_on_alignment=["targets_ptr"])
def _stats_kernel(x_ptr, x_stride, targets_ptr, lse_ptr, chosen_ptr, rank_ptr, V, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * x_stride
    xt = tl.load(row + tl.load(targets_ptr + r)).to(tl.float32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    above = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # 0 for a lane that has seen no finite logit yet: exp(-inf - 0) adds nothing (no -inf - -inf)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
        above += (x > xt).to(tl.int32)
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    tl.store(lse_ptr + r, lse)
    tl.store(chosen_ptr + r, xt - lse)
    tl.store(rank_ptr + r, tl.sum(above, axis=0).to(tl.int64) + 1)


def logprob_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] (any float dtype, rows contiguous), targets [R] int64 -> (log-sum-exp [R] float32,
    the targets' logprobs [R] float32, their ranks [R] int64)."""
    assert logits.dim() == 2 and logits.stride(1) == 1 and logits.is_floating_point()
    r, V = logits.shape
    assert targets.shape == (r,) and targets.dtype == torch.int64 and targets.is_contiguous()
    lse = torch.empty(r, dtype=torch.float32, device=logits.device)
    chosen = torch.empty_like(lse)
    rank = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r:
        launch(_stats_kernel, (r,), logits, logits.stride(0), targets, lse, chosen, rank, V, BLOCK=BLOCK, num_warps=8)
    return lse, chosen, rank
