"""Incremental detokenization and stop strings, per request.

Text is produced by decoding a small window of recent tokens and emitting what grew, so a
multi-byte character split across tokens is held until complete. Text that could be the start
of a stop string is held back too, so streamed deltas always concatenate to the final text.
"""
from __future__ import annotations

import codecs
from typing import Any

from scheduler.request import SamplingParams


class IncrementalDetokenizer:
    """token_bytes: an id -> bytes table (scheduler/token_bytes.py) for byte-level tokenizers; with
    it, text comes from an incremental UTF-8 decoder instead of the tokenizer."""

    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True,
                 token_bytes: list[bytes] | None = None, include_stop: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        # stop strings count only from the (min_tokens + 1)-th token on (vLLM's rule), and only where
        # they end in text decoded from then on
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.unchecked = 0  # characters of text decoded before stop strings counted
        self.include_stop = include_stop  # the text ends after the stop string instead of before it
        self.skip_special = skip_special_tokens
        self.token_bytes = token_bytes
        self.partial = b""  # with token_bytes: the start of a UTF-8 character whose other bytes are still to come
        self.ids: list[int] = []  # without token_bytes: every id so far (a window of them is decoded)
        self.prefix_offset = 0
        self.read_offset = 0
        # All decoded output text (up to a stop string, once one is found); kept only where held-back
        # text and stop strings need it: with token_bytes and no stop strings, text goes out as decoded.
        self.text = ""
        self.emitted = 0  # characters of text already handed out
        self.stopped = False

    @classmethod
    def for_params(cls, tokenizer: Any, params: SamplingParams,
                   token_bytes: dict[bool, list[bytes] | None]) -> IncrementalDetokenizer:
        """One request's detokenizer; token_bytes: the id -> bytes table by skip_special_tokens."""
        return cls(tokenizer, params.stop, params.skip_special_tokens, token_bytes[params.skip_special_tokens],
                   params.include_stop_str_in_output, params.min_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Feed new token ids; return the text that can be emitted now. Sets self.stopped when a
        stop string appears (the text is cut before it). final=True flushes held-back text."""
        if self.stopped:
            return ""
        self.num_tokens += len(new_ids)
        if self.token_bytes is not None:
            decoded = self._decode_bytes(new_ids, final)
            if not self.stop:  # the common case: nothing is held back, everything decoded is emitted
                self.emitted += len(decoded)
                return decoded
            self.text += decoded
        else:
            self.ids.extend(new_ids)
            self._decode_window(final)
        checking = bool(self.stop) and self.num_tokens > self.min_tokens
        if checking:
            self._find_stop()
        else:
            self.unchecked = len(self.text)
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._held_back()
        delta = self.text[self.emitted:max(end, self.emitted)]
        self.emitted += len(delta)
        return delta

    def _decode_bytes(self, ids: list[int], final: bool) -> str:
        """Incremental UTF-8 decoding of the ids' bytes (what codecs' incremental decoder does,
        without its per-call overhead): an incomplete character at the end waits for its next bytes."""
        table = self.token_bytes
        if len(ids) == 1:  # a decode step's one token
            i = ids[0]
            data = self.partial + (table[i] if 0 <= i < len(table) else b"")
        else:
            data = self.partial + b"".join(table[i] if 0 <= i < len(table) else b"" for i in ids)
        text, used = codecs.utf_8_decode(data, "replace", final)
        self.partial = data[used:]
        return text

    def _decode_window(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        elif final and full.endswith("\ufffd") and len(full) > len(prefix):
            self.text += full[len(prefix):]

    def _find_stop(self) -> None:
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, max(start, self.unchecked - len(s) + 1)), s)
                                          for s in self.stop) if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the first stop string in the text; the longest of those starting there
            self.text = self.text[:at - minus_len if self.include_stop else at]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
