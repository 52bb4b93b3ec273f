"""Embeddings (SamplingParams.pooling): a prompt's final hidden states (after the model's last norm)
pooled on the device by the step that computes each chunk of it: the row of its last token
("last"), the sum of its rows ("mean"; the sequence divides by the prompt's length), or the row
of its first token ("cls"). Each chunk's share goes to Sequence.add_pooled, copied to the host
behind the step's work like prompt logprobs.
"""
from __future__ import annotations

from array import array

import torch

from scheduler.request import ScheduledSeq

Span = tuple[int, int, int]  # (item index, first row of the step's hidden states, number of rows)


def pooled_spans(items: list[ScheduledSeq]) -> list[Span]:
    """The rows of a step (its items' tokens in order) that each pooling item's chunk adds up."""
    spans: list[Span] = []
    offset = 0
    for i, it in enumerate(items):
        how = it.seq.params.pooling
        prompt = it.seq.num_prompt_tokens
        if how is not None and it.start < prompt:
            end = min(it.end, prompt)
            if how == "mean":
                spans.append((i, offset, end - it.start))
            elif how == "last" and end == prompt:
                spans.append((i, offset + end - 1 - it.start, 1))
            elif how == "cls" and it.start == 0:
                spans.append((i, offset, 1))
        offset += it.num_new_tokens
    return spans


class PooledSamples:
    """A step's pooled rows on the device (float32, one per span), copied to the host behind the
    step's work; to_host() waits for them."""

    def __init__(self, hidden: torch.Tensor, spans: list[Span]) -> None:
        self.items = [i for i, _, _ in spans]
        vectors = torch.stack([hidden[first:first + count].float().sum(0) for _, first, count in spans])
        self._ready: torch.cuda.Event | None = None
        if vectors.device.type == "cuda":
            vectors = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True).copy_(vectors, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._vectors = vectors

    def to_host(self) -> dict[int, array]:
        """item index -> its chunk's share, an array of floats."""
        if self._ready is not None:
            self._ready.synchronize()
        rows = self._vectors.numpy()
        return {i: array("f", rows[j].tobytes()) for j, i in enumerate(self.items)}
