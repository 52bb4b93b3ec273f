"""Draft tokens for speculative decoding by n-gram lookup (prompt lookup): the sequence's last n
tokens are looked up earlier in its own prompt and output, and the tokens that followed their most
recent earlier occurrence are the draft; the longest n from max_n down to min_n that occurs wins.
Where text repeats (code edits, quoting, extraction, summaries) the model often continues the same
way, and a step then verifies several tokens for the weight reads of one.

Per sequence, an index from each n-gram (min_n..max_n) to the position after its most recent
occurrence, extended as tokens arrive: each step costs O(new tokens), not O(context). Its settings:
scheduler/request.py SpeculativeConfig. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# new positions past which the index is extended n by n in C (a prompt at its first draft: 2.5x
# faster) rather than position by position (the few tokens of a step: 2.4x faster)
BULK = 16


@dataclass
class _Index:
    tokens: list[int]  # the sequence's token list (the scheduler's, extended in place)
    upto: int = 0  # n-grams ending before this position are indexed
    after: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> the position after it


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n and num_tokens >= 1
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self._index: dict[int, _Index] = {}

    def propose(self, seq_id: int, tokens: list[int], limit: int) -> list[int]:
        """Up to min(limit, num_tokens) tokens to follow `tokens`, or [] where the last n-gram has
        not occurred before."""
        limit = min(limit, self.num_tokens)
        if limit <= 0 or len(tokens) <= self.min_n:
            return []
        idx = self._index.get(seq_id)
        if idx is None or idx.tokens is not tokens or idx.upto > len(tokens):
            idx = self._index[seq_id] = _Index(tokens)
        last = len(tokens) - 1  # the n-grams ending at the last token are the query, not yet indexed
        after = idx.after
        if last - idx.upto > BULK:
            for n in range(self.min_n, self.max_n + 1):
                # the n-grams ending at positions first..last-1, each -> the position after it, later
                # ones overwriting earlier ones: built and inserted in C
                first = max(idx.upto, n - 1)
                if first < last:
                    columns = [tokens[first - n + 1 + i:last - n + 1 + i] for i in range(n)]
                    after.update(zip(zip(*columns), range(first + 1, last + 1)))
        else:
            for end in range(idx.upto, last):
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    after[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        idx.upto = max(idx.upto, last)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            at = after.get(tuple(tokens[size - n:]))
            if at is not None:
                # what followed; where that runs into the tokens being predicted (a repeat of period
                # size - at), those predictions continue it
                draft: list[int] = []
                for src in range(at, at + limit):
                    draft.append(tokens[src] if src < size else draft[src - size])
                return draft
        return []

    def drop(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._index)
