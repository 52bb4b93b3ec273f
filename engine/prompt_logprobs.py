"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's field; echo with logprobs on /v1/completions):
the logprob of each prompt token under the logits of the position before it, its rank, and the top
tokens there, from the final hidden states of the step that computes the prompt's chunk.

A chunk at positions [start, end) gives the logprobs of prompt tokens start + 1 .. min(end, P - 1):
the last prompt position's logits sample the first output token instead. The logits are made a slice
of rows at a time (at most max_num_seqs rows, as many as a full decode step's), so a long chunk
costs no more memory than the sampler's worst case, which start-up measures.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scheduler.request import PromptChunk, ScheduledSeq


@dataclass
class PromptRows:
    """Which rows of a step's tokens give prompt logprobs, and for whom."""
    rows: list[int]  # rows of the step's hidden states, in item order
    targets: list[int]  # the prompt token each row's logits score
    spans: list[tuple[int, int]]  # (item index, its number of rows), in order
    top: int  # the most top tokens any item asks for


def prompt_rows(items: list[ScheduledSeq]) -> PromptRows | None:
    """The rows of a step (its items' tokens in order) whose logits give prompt logprobs, or None."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[int, int]] = []
    top = 0
    offset = 0
    for i, it in enumerate(items):
        seq = it.seq
        if seq.params.prompt_logprobs is not None and seq.wants_prompt_logprobs:  # the first test costs least
            stop = min(it.end, seq.num_prompt_tokens - 1)
            if stop > it.start:
                rows.extend(range(offset, offset + stop - it.start))
                targets.extend(seq.token_ids[it.start + 1:stop + 1])
                spans.append((i, stop - it.start))
                top = max(top, seq.params.prompt_logprobs or 0)
        offset += it.num_new_tokens
    return PromptRows(rows, targets, spans, top) if rows else None


class PromptSamples:
    """A step's prompt logprobs on the device, copied to the host behind the step's work; to_host()
    waits for them."""

    def __init__(self, rows: PromptRows, items: list[ScheduledSeq], chosen: torch.Tensor, ranks: torch.Tensor,
                 top_vals: torch.Tensor, top_ids: torch.Tensor) -> None:
        self.spans = rows.spans
        self.wanted = [items[i].seq.params.prompt_logprobs or 0 for i, _ in rows.spans]
        self._ready: torch.cuda.Event | None = None
        parts = (chosen, ranks, top_vals, top_ids)
        if chosen.device.type == "cuda":
            parts = tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                          for p in parts)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._parts = parts

    def to_host(self) -> dict[int, PromptChunk]:
        """item index -> its chunk's prompt logprobs, as arrays (no object per token on the engine's
        loop: the API process builds the entries it writes)."""
        if self._ready is not None:
            self._ready.synchronize()
        chosen, ranks, vals, ids = (p.numpy() for p in self._parts)
        at = 0
        out: dict[int, PromptChunk] = {}
        for (item, count), k in zip(self.spans, self.wanted):
            rows = slice(at, at + count)
            out[item] = PromptChunk(array("f", chosen[rows].tobytes()), array("q", ranks[rows].tobytes()),
                                    array("q", ids[rows, :k].tobytes()), array("f", vals[rows, :k].tobytes()))
            at += count
        return out


def compute_prompt_logprobs(hidden: torch.Tensor, rows: PromptRows, items: list[ScheduledSeq],
                            logits_of: Callable[[torch.Tensor], torch.Tensor], max_rows: int) -> PromptSamples:
    """hidden: the step's final hidden states [T, H] (after the last norm); logits_of: the model's
    head (every rank of a tensor-parallel group calls it the same number of times). The top tokens
    come from the logits as they are (the same order as their logprobs'), the top one by a max."""
    device = hidden.device
    if device.type == "cuda":
        from kernels.logprob_stats import logprob_stats  # Triton: only on a GPU
    else:
        from kernels.reference import logprob_stats
    index = torch.tensor(rows.rows, dtype=torch.int64)
    targets = torch.tensor(rows.targets, dtype=torch.int64)
    if device.type == "cuda":
        index, targets = (t.pin_memory().to(device, non_blocking=True) for t in (index, targets))
    k = rows.top
    chosen, ranks, top_vals, top_ids = [], [], [], []
    for s in range(0, len(rows.rows), max_rows):
        logits = logits_of(hidden[index[s:s + max_rows]])
        lse, c, rank = logprob_stats(logits, targets[s:s + max_rows])
        chosen.append(c)
        ranks.append(rank)
        if k == 1:
            v, i = logits.max(dim=-1, keepdim=True)
        elif k > 1:
            v, i = logits.topk(k, dim=-1)
        else:
            v, i = logits.new_empty(len(c), 0), torch.empty(len(c), 0, dtype=torch.int64, device=device)
        top_vals.append(v.float() - lse.unsqueeze(1))
        top_ids.append(i)
    return PromptSamples(rows, items, torch.cat(chosen), torch.cat(ranks), torch.cat(top_vals), torch.cat(top_ids))
