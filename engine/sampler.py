"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, and logprobs.

Random rows sample with the exponential race (argmax of p / E, E ~ Exp(1)), which draws exactly
from p. A seeded request draws its noise from a generator seeded by (seed, output position), so
its tokens don't depend on what else is in the batch, and a preempted request recomputes the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.request import SamplingParams, TokenLogprob


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, built by the runner for the rows that sample."""
    params: list[SamplingParams]
    output_positions: list[int]  # how many tokens each row's sequence has generated so far

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def max_logprobs(self) -> int | None:
        wanted = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(wanted) if wanted else None


def _seed_for(seed: int, position: int) -> int:
    return (seed * 0x9E3779B1 + position * 0x85EBCA77 + 1) % (2**63 - 1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [N, V] outside each row's top-k and top-p nucleus with -inf.
    top_k [N] long (V = disabled), top_p [N] float (1 = disabled)."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    mask = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    # Drop a token when the tokens ranked before it already reach top_p; the top token always stays.
    mask |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [N, V] float32 -> one token id per row (and logprobs for the rows that asked)."""
    n, vocab = logits.shape
    device = logits.device
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in batch.params],
                             device=device, dtype=torch.float32)
        scaled = logits / temps.unsqueeze(1)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in batch.params], device=device)
        top_p = torch.tensor([p.top_p for p in batch.params], device=device, dtype=torch.float32)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in batch.params):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, p in enumerate(batch.params):
            if p.seed is not None and not p.greedy:
                g = torch.Generator(device=device).manual_seed(_seed_for(p.seed, batch.output_positions[i]))
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in batch.params], device=device)
        tokens = torch.where(is_greedy, greedy_tokens, sampled)
    k = batch.max_logprobs
    if k is None:
        return tokens.tolist(), [None] * n
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
    token_list = tokens.tolist()
    chosen_l, vals_l, ids_l = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = []
    for i, p in enumerate(batch.params):
        if p.logprobs is None:
            out.append(None)
            continue
        top = list(zip(ids_l[i][:p.logprobs], vals_l[i][:p.logprobs]))
        out.append(TokenLogprob(token_list[i], chosen_l[i], top))
    return token_list, out
