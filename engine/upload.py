"""Pinned host buffers for a step's host-to-device upload, used in turn.

`tensor.pin_memory()` on a fresh tensor every step goes through the pinned-memory allocator,
which measured 0.3 to 3 ms a call on the H100 machine for a mixed step's ~100 KB (bench/NOTES.md),
more than the copy. A ring of buffers allocated once costs a memcpy into pinned memory instead;
a buffer is rewritten only once its last copy has left (an event), which the host waits for only
if it runs a whole ring of uploads ahead of the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HostInputs:
    """One step's inputs on the host (engine/runner.py prepare()): int64 [ids | positions | slots |
    logit indices | pending at | pending rows], int32 [seq_lens | query starts | prefill query
    starts | tables]."""
    i64: np.ndarray
    i32: np.ndarray
    num_tokens: int
    head: int  # where the tables start in i32
    width: int  # the block-table columns used; stale ones beyond are never read
    max_query_len: int
    sampled: list[int]  # the items that sample
    num_pending: int  # input tokens read from prev's samples on the device

    @property
    def num_logits(self) -> int:
        """Rows of logits the step samples from: one per sampling item, a draft's tokens and one more
        per item that verifies a draft."""
        return len(self.i64) - 3 * self.num_tokens - 2 * self.num_pending


def take_pending(input_ids: torch.Tensor, words: torch.Tensor, num_pending: int, samples: torch.Tensor) -> None:
    """The pending input tokens into input_ids, on the device: words (int64, uploaded) holds
    num_pending rows of input_ids, then as many rows of samples (the previous step's tokens)."""
    k = num_pending
    input_ids.index_copy_(0, words[:k], samples.index_select(0, words[k:2 * k]))


class UploadRing:
    def __init__(self, nbytes: int, slots: int = 2) -> None:
        self.nbytes = nbytes
        self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._np = [h.numpy() for h in self._host]
        self._sent = [torch.cuda.Event() for _ in range(slots)]
        self._slot = 0

    def buffer(self) -> np.ndarray:
        """The pinned bytes to write the next upload into (free once its previous copy has left)."""
        i = self._slot
        self._sent[i].synchronize()
        return self._np[i]

    def send(self, dst: torch.Tensor, nbytes: int) -> None:
        """Copy the first nbytes of buffer() into dst (a uint8 device tensor) behind the work
        already queued, and move on to the next buffer."""
        i = self._slot
        self._slot = (i + 1) % len(self._host)
        dst[:nbytes].copy_(self._host[i][:nbytes], non_blocking=True)
        self._sent[i].record()
