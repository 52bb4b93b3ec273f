"""The benchmark workload: random token-id prompts (or their text) and their arrival schedule, both seeded."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    """num_prompts prompts of about input_len tokens asking for about output_len tokens.

    Lengths are drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)].
    The first shared_prefix_len tokens of every prompt are the same; they count towards the
    prompt's length, so a prompt is never shorter than the shared prefix.
    """

    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    shared_prefix_len: int = 0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.shared_prefix_len < 0:
            raise ValueError(f"--shared-prefix-len must be >= 0, got {self.shared_prefix_len}")
        if self.shared_prefix_len > self.min_input_len:
            raise ValueError(
                f"--shared-prefix-len {self.shared_prefix_len} is longer than the shortest prompt "
                f"({self.min_input_len} tokens); lower it or raise --input-len")

    @property
    def min_input_len(self) -> int:
        return length_range(self.input_len, self.range_ratio)[0]


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: list[int] | str  # token ids, or text the server tokenizes
    output_len: int
    prompt_tokens: int = 0  # the prompt's length in tokens (0: len(prompt), which are token ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens or len(self.prompt)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] lengths for a mean length and a range ratio (never below 1)."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def make_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    # Separate streams for lengths and tokens, so changing one option doesn't reshuffle the other.
    len_rng = np.random.default_rng([spec.seed, 0])
    tok_rng = np.random.default_rng([spec.seed, 1])
    in_lo, in_hi = length_range(spec.input_len, spec.range_ratio)
    out_lo, out_hi = length_range(spec.output_len, spec.range_ratio)
    input_lens = len_rng.integers(in_lo, in_hi + 1, size=spec.num_prompts)
    output_lens = len_rng.integers(out_lo, out_hi + 1, size=spec.num_prompts)
    prefix = tok_rng.integers(0, spec.vocab_size, size=spec.shared_prefix_len).tolist()
    requests = []
    for i in range(spec.num_prompts):
        suffix = tok_rng.integers(0, spec.vocab_size, size=int(input_lens[i]) - spec.shared_prefix_len)
        requests.append(BenchRequest(index=i, prompt=prefix + suffix.tolist(), output_len=int(output_lens[i])))
    return requests


def as_text(requests: list[BenchRequest], tokenizer: Any) -> list[BenchRequest]:
    """The same requests with text prompts (--prompt-format text) that the server's tokenizer reads as
    as many tokens as the ids were (texts_of_length); prompt_tokens is that count."""
    assert not any(isinstance(r.prompt, str) for r in requests)
    texts = texts_of_length([list(r.prompt) for r in requests], tokenizer)
    return [replace(r, prompt=text, prompt_tokens=n) for r, (text, n) in zip(requests, texts)]


MAX_FIT_ROUNDS = 16
FILLER_IDS = 256


def texts_of_length(prompts: list[list[int]], tokenizer: Any) -> list[tuple[str, int]]:
    """For each list of ids, text made of them that tokenizer.encode(text) reads as as many tokens,
    as a server counts a text prompt (the special tokens it adds, such as a BOS, included), and that
    count.

    Decoded ids (special tokens left out) need not re-encode to as many tokens: neighbours merge, a
    special token drops out, a character cut in its bytes becomes U+FFFD (3 byte-level tokens). Too
    many: the text is cut to the wanted tokens; too few: more of the ids' own text (then of the first
    FILLER_IDS ids) goes on the end; until the count is right. Should a text not come right within
    MAX_FIT_ROUNDS, its count is its own, so that what the benchmark reports stays what the server
    did. Each round encodes its texts in one batch call (the Rust tokenizer spreads it over the cores).
    Where the first decode already reads right (every 512-token prompt of the SmolLM2 tokenizer
    tried), the text is what it was before this fitting existed."""
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts]
    # to top a text up: its own ids, then low ids (in a byte-level vocabulary, single bytes)
    spares = [itertools.cycle([*ids, *range(FILLER_IDS)]) for ids in prompts]
    counts = [len(ids) for ids in prompts]
    todo = list(range(len(prompts)))
    for round_ in range(MAX_FIT_ROUNDS + 1):
        # as the server tokenizes a prompt: special tokens added
        full = _encode_all(tokenizer, [texts[i] for i in todo], add_special_tokens=True)
        off = [(i, len(f)) for i, f in zip(todo, full) if len(f) != counts[i]]
        if not off or round_ == MAX_FIT_ROUNDS:
            for i, n in off:  # out of rounds: the text as it is, with its own count
                counts[i] = n
            break
        todo = [i for i, _ in off]
        bodies = _encode_all(tokenizer, [texts[i] for i in todo], add_special_tokens=False)
        for (i, n), body in zip(off, bodies):
            want = max(0, counts[i] - (n - len(body)))  # less the special tokens the server adds
            if len(body) > want:
                texts[i] = _cut(tokenizer, body, want)
            else:
                texts[i] += _more_text(tokenizer, spares[i], want - len(body), len(prompts[i]) + FILLER_IDS)
    return list(zip(texts, counts))


def _more_text(tokenizer: Any, spare: Iterator[int], n: int, tries: int) -> str:
    """The text of the next n ids of spare that have text of their own (special tokens have none)."""
    picked: list[int] = []
    for _ in range(tries):
        if len(picked) == n:
            break
        i = next(spare)
        if tokenizer.decode([i], skip_special_tokens=True):
            picked.append(i)
    return tokenizer.decode(picked, skip_special_tokens=True)


def _cut(tokenizer: Any, ids: list[int], want: int) -> str:
    """The text of ids' first `want` tokens, or of fewer where a cut inside a character's bytes would
    decode to a replacement character that encodes to more tokens than it stands for."""
    for k in range(want, max(-1, want - 4), -1):
        text = tokenizer.decode(ids[:k])
        if len(tokenizer.encode(text, add_special_tokens=False)) <= want:
            return text
    return text


def _encode_all(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """tokenizer.encode of each text, in one call where the tokenizer takes a batch."""
    if not texts:
        return []
    if hasattr(tokenizer, "batch_decode"):  # a transformers tokenizer: called with a list, it encodes a batch
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
    return [list(tokenizer.encode(t, add_special_tokens=add_special_tokens)) for t in texts]


def warmup_requests(spec: WorkloadSpec, n: int) -> list[BenchRequest]:
    """n requests shaped like spec's (same lengths, a shared prefix of the same length) but with
    other tokens: they compile and warm the server without putting the measured prompts, or
    their shared prefix, into its prefix cache."""
    if n <= 0:
        return []
    other = replace(spec, num_prompts=n, seed=spec.seed + 1_000_003)
    return make_requests(other)


def fresh_tokens(requests: list[BenchRequest], spec: WorkloadSpec, run: int) -> list[BenchRequest]:
    """The requests of run `run` of a rate sweep: the same lengths and shared prefix, other tokens
    after it, so that no run finds an earlier run's prompts in the server's prefix cache. Run 0
    keeps the requests as they are."""
    if run == 0:
        return requests
    rng = np.random.default_rng([spec.seed, 3, run])
    out = []
    for r in requests:
        assert not isinstance(r.prompt, str)
        suffix = rng.integers(0, spec.vocab_size, size=len(r.prompt) - spec.shared_prefix_len).tolist()
        out.append(replace(r, prompt=r.prompt[:spec.shared_prefix_len] + suffix))
    return out


def arrival_offsets(num_requests: int, request_rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at request_rate
    requests/s, or all at once when request_rate is None or infinite."""
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    rng = np.random.default_rng([seed, 2])
    gaps = rng.exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()


@dataclass(frozen=True)
class Conversation:
    """One conversation of a multi-turn run (serve bench --multi-turn): the new tokens of each turn
    (the first turn's are spec.input_len long, each later turn's turn_len) and each turn's max_tokens.
    Turn t's prompt is the conversation so far, its earlier prompts and replies, then turns[t]."""

    index: int
    turns: list[list[int]]
    output_lens: list[int]

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def request(self, turn: int, history: list[int]) -> BenchRequest:
        """Turn `turn`'s request after `history` (the previous prompt and the reply to it)."""
        return BenchRequest(index=self.index * self.num_turns + turn, prompt=history + self.turns[turn],
                            output_len=self.output_lens[turn])


def make_conversations(spec: WorkloadSpec, num_turns: int, turn_len: int) -> list[Conversation]:
    """spec.num_prompts conversations of num_turns turns. Lengths vary by spec.range_ratio; the first
    turns share spec.shared_prefix_len tokens, as make_requests' prompts do (a system prompt)."""
    if num_turns < 1:
        raise ValueError(f"--multi-turn must be >= 1 turns, got {num_turns}")
    if turn_len < 1:
        raise ValueError(f"--turn-len must be >= 1, got {turn_len}")
    firsts = make_requests(spec)
    len_rng = np.random.default_rng([spec.seed, 4])
    tok_rng = np.random.default_rng([spec.seed, 5])
    t_lo, t_hi = length_range(turn_len, spec.range_ratio)
    out_lo, out_hi = length_range(spec.output_len, spec.range_ratio)
    out = []
    for first in firsts:
        assert not isinstance(first.prompt, str)
        turns = [list(first.prompt)]
        outputs = [first.output_len]
        for _ in range(num_turns - 1):
            n = int(len_rng.integers(t_lo, t_hi + 1))
            turns.append(tok_rng.integers(0, spec.vocab_size, size=n).tolist())
            outputs.append(int(len_rng.integers(out_lo, out_hi + 1)))
        out.append(Conversation(first.index, turns, outputs))
    return out


def max_conversation_tokens(conversations: list[Conversation]) -> int:
    """The longest final context of any conversation (every turn's tokens and max_tokens)."""
    return max((sum(map(len, c.turns)) + sum(c.output_lens) for c in conversations), default=0)
