"""The mixture-of-experts layer in plain torch: the reference of kernels/moe.py and the CPU path.

x [T, H] goes to each token's top-k experts; expert e computes silu(x @ gate_e.T) * (x @ up_e.T),
then @ down_e.T, scaled by the token's routing weight for e; the k results are summed per token.
w13 [E, 2I, H] holds each expert's gate rows then up rows, w2 [E, H, I] its down projection.

Rounding as the fused kernel does it: gate/up, the activation and each expert's output in x's
dtype, the routing weight applied in float32 and rounded, the k rows summed in float32.

Expert parallelism: a rank holds experts [expert_start, expert_start + E) of the model's; a token's
pick of another rank's expert adds nothing here (that rank adds it, and the all-reduce sums).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32): softmax over all
    experts in float32, the top k, renormalized to sum to 1 when asked (Mixtral always: the same as
    a softmax over the top-k logits)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0, num_global_experts: int | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] (the
    model's expert ids) -> [T, H] in x's dtype. num_global_experts: unused here (kernels/moe.py
    zero-fills with it)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the torch mixture-of-experts reference syncs with the host, which CUDA graphs can't "
                           "capture: on a GPU use the Triton backend, or --enforce-eager with --backend torch")
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    local = topk_ids.long() - expert_start
    rows = torch.zeros((t, k, x.shape[1]), dtype=x.dtype, device=x.device)
    for e in range(num_experts):
        tok, slot = torch.where(local == e)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        rows[tok, slot] = (y.float() * topk_weights[tok, slot, None].float()).to(x.dtype)
    return rows.sum(dim=1, dtype=torch.float32).to(x.dtype)
