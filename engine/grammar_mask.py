"""The token mask of constrained rows: grammar state per sequence on the host, a bitmask per step,
applied to the logits on the device before sampling.

A sequence's matcher follows its output tokens: before its mask is filled it consumes the tokens
the sequence has gained since (so a sampled token is accepted when the scheduler has appended it,
a preempted sequence that keeps its tokens keeps its state, and a sequence whose tokens were cut
back is replayed from the start). Matchers of finished sequences are dropped at the next fill.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.grammar import GrammarTokenizer, first_line
from scheduler.request import ScheduledSeq, Sequence

log = logging.getLogger("pagedserve")


@dataclass
class _State:
    seq: Sequence
    matcher: Any  # llguidance.LLMatcher
    num_accepted: int = 0  # output tokens consumed


def _is_constrained(seq: Sequence) -> bool:
    # a sequence finished (ended, aborted) after its step was launched samples nothing that counts
    return seq.params.grammar is not None and not seq.is_finished


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [R, W] int32 (bit t % 32 of word t // 32 allows token t) -> allowed [R, vocab] bool;
    tokens past 32 * W are not allowed."""
    if bitmask.device.type == "cpu":  # numpy's unpackbits: several times faster than torch's ops here
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    return unpack_bitmask_torch(bitmask, vocab)


def unpack_bitmask_torch(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """unpack_bitmask with torch's elementwise ops (the device's path; a handful of small kernels)."""
    r, w = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(r, w * 32).bool()
    if w * 32 >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(r, vocab - w * 32)], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits [N, V] of rows `rows` [R] (ascending) set to -inf where their row of
    bitmask [R, W] disallows the token, outside any CUDA graph. R == N: every row, in place."""
    disallowed = unpack_bitmask(bitmask, logits.shape[1]).logical_not_()
    if bitmask.shape[0] == logits.shape[0]:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(disallowed, float("-inf")))


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """apply_token_bitmask, token by token in Python (tests)."""
    out = logits.clone()
    words = bitmask.tolist()
    for j, row in enumerate(rows):
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= len(words[j]) or not (words[j][word] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


class GrammarMasks:
    """Matchers of the constrained sequences, keyed by sequence id; a step's constrained rows are
    filled by several threads into a bitmask in pinned memory. Each step takes a new one: torch's
    pinned-memory cache hands a block out again only after the copies queued from it have run,
    so a step launched before the last one's copy left never overwrites it."""

    def __init__(self, tokenizer: GrammarTokenizer, device: torch.device, threads: int = 4) -> None:
        import llguidance

        self.tokenizer = tokenizer
        self.device = device
        self.words = bitmask_words(tokenizer.vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=max(1, threads))
        self._states: dict[int, _State] = {}
        self._prototypes: dict[str, Any] = {}  # grammar -> a fresh matcher to copy (the compile is paid once)

    @staticmethod
    def constrained(items: list[ScheduledSeq]) -> bool:
        return any(_is_constrained(it.seq) for it in items)

    @staticmethod
    def tokens_known(items: list[ScheduledSeq]) -> bool:
        """Whether every constrained row's tokens before the one it samples are on the host (not
        pending from a step in flight): its mask can be filled now."""
        return all(len(it.seq.token_ids) >= it.end for it in items if _is_constrained(it.seq))

    def masks(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of `items` (a step's sampling rows, in order) that are constrained: (bitmask
        [R, W] int32, row indices [R] int64), both on the device (queued copies), or None."""
        self._drop_finished()
        rows: list[int] = []
        matchers: list[tuple[Any, int]] = []
        for j, it in enumerate(items):
            if not _is_constrained(it.seq):
                continue
            state = self._sync(it)
            matchers.append((state.matcher, len(rows)))
            rows.append(j)
        if not rows:
            return None
        r = len(rows)
        host = torch.empty((r, self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, matchers, host)
        for matcher, _ in matchers:
            if matcher.is_error():
                # its mask allows only end-of-sequence: the row ends instead of derailing
                log.warning("a grammar matcher failed: %s", matcher.get_error().splitlines()[0][:200])
        index = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cpu":
            return host, index
        return host.to(self.device, non_blocking=True), index.pin_memory().to(self.device, non_blocking=True)

    def _sync(self, it: ScheduledSeq) -> _State:
        seq = it.seq
        assert len(seq.token_ids) >= it.end, "a constrained row's mask needs its earlier tokens on the host"
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = _State(seq, self._new_matcher(seq.params.grammar))
        outputs = seq.token_ids[seq.num_prompt_tokens:it.end]
        if state.num_accepted > len(outputs):  # tokens were taken back: start over
            state.matcher.reset()
            state.num_accepted = 0
        new = outputs[state.num_accepted:]
        if new:
            state.matcher.consume_tokens(new)
            state.num_accepted = len(outputs)
        return state

    def _new_matcher(self, grammar: str) -> Any:
        proto = self._prototypes.get(grammar)
        if proto is None:
            import llguidance

            if len(self._prototypes) >= 256:
                self._prototypes.clear()
            proto = self._prototypes[grammar] = llguidance.LLMatcher(self.tokenizer.get(), grammar)
        return proto.deep_copy()

    def _drop_finished(self) -> None:
        done = [sid for sid, st in self._states.items() if st.seq.is_finished]
        for sid in done:
            del self._states[sid]

    def __len__(self) -> int:
        return len(self._states)


def build_grammar_masks(tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | frozenset[int],
                        device: torch.device) -> GrammarMasks | None:
    """A runner's constrained-decoding state, or None where the tokenizer can't drive a grammar.
    Its vocabulary index (~0.6 s) is built on a thread now, not on the first constrained step."""
    if GrammarTokenizer.supported(tokenizer) is not None:
        return None
    grammar_tokenizer = GrammarTokenizer(tokenizer, vocab_size, sorted(eos_token_ids))

    def build() -> None:  # a failure shows again, to the first request with a grammar
        try:
            grammar_tokenizer.get()
        except Exception as e:
            log.warning("structured output: the grammar engine could not read the tokenizer: %s", first_line(str(e)))

    threading.Thread(target=build, name="grammar-vocabulary", daemon=True).start()
    return GrammarMasks(grammar_tokenizer, device, threads=min(8, os.cpu_count() or 1))
