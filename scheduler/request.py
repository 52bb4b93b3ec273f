"""The vocabulary every layer shares: sampling parameters, sequences, batches, step outputs.

Torch-free. A sequence is a plain object with counters; its phase follows from them:
it is prefilling while num_computed_tokens < len(token_ids) - 1, decoding after.
"""
from __future__ import annotations

import enum
import itertools
import signal
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvcache.block_manager import lora_root
from kvcache.host_tier import KVMoves


@dataclass(frozen=True)
class KVTransferParams:
    """hand_off (a prefill engine): keep the prompt's KV blocks after the first token, for a decode
    engine to pull. remote_tokens (a decode engine): the KV of the first remote_tokens tokens arrives
    from a prefill engine; the tokens after them were generated there."""

    hand_off: bool = False
    remote_tokens: int = 0


@dataclass
class SamplingParams:
    """Per-request generation settings (the OpenAI fields plus a few vLLM extensions).

    temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text ends with the stop string found, instead of before it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: each prompt token's logprob (its rank, and this many top tokens) from the prompt's own
    # forward; the first token has none. Such a prompt is computed whole, not read from the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # what the logits go through before sampling, in vLLM's order (engine/logit_adjust.py): tokens
    # outside allowed_token_ids banned; stop and end-of-sequence tokens banned while fewer than
    # min_tokens are out; logit_bias added; the
    # repetition penalty (prompt and output tokens), then frequency and presence (output tokens);
    # min_p after the temperature
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    # constrained decoding: every sampled token keeps the output inside this grammar (an llguidance
    # grammar string, built and checked by engine/grammar.py); the grammar lets end-of-sequence
    # through only where its output is complete
    grammar: str | None = None
    # disaggregated prefill/decode (scheduler/disagg.py): where this sequence's KV comes from or goes
    kv_transfer: KVTransferParams | None = None
    # the LoRA adapter that serves this request, by name (the engine core sets `lora` from it) or by
    # its number in the engine (scheduler/lora.py); 0 = none
    lora_name: str | None = None
    lora: int = 0
    # an embedding request (/v1/embeddings, LLM.embed): the prompt's final hidden states pooled, by
    # its last token, their mean or its first token (POOLING); the one token sampled is not shown
    pooling: str | None = None
    # vLLM's: a lower value runs sooner; a waiting sequence takes the place of running ones of a
    # higher value where it could not start otherwise (scheduler/policy.py)
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if isinstance(self.lora, bool) or not isinstance(self.lora, int) or self.lora < 0:
            raise ValueError(f"lora must be an adapter's number (1, 2, ...) or 0 for none, got {self.lora!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= 20):
                raise ValueError(f"{name} must be between 0 and 20, got {k!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.pooling is not None and (self.pooling not in POOLING or self.max_tokens != 1):
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, with max_tokens 1; got {self.pooling!r} "
                             f"with max_tokens {self.max_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not (self.repetition_penalty > 0.0) or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be between 0 and 1, got {self.min_p!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted(set(int(t) for t in self.allowed_token_ids))
            if not self.allowed_token_ids or self.allowed_token_ids[0] < 0:
                raise ValueError("allowed_token_ids must name at least one token id, all >= 0")
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        if any(t < 0 or not (-100.0 <= b <= 100.0) for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids (>= 0) to biases between -100 and 100")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """The logits depend on the tokens so far (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Anything of engine/logit_adjust.py applies to this request's rows."""
        return (self.penalizes or self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None
                or (self.min_p > 0.0 and self.temperature > 0.0))


def startup_lora_slots(count: int) -> dict[int, int]:
    """The start-up adapters' numbers (SamplingParams.lora) and slots: 1..count in slots 0..count-1,
    as the runner writes them and scheduler/lora.py's registry knows them."""
    return {i + 1: i for i in range(count)}


POOLING = ("last", "mean", "cls")
SPECULATIVE_METHODS = ("ngram", "draft_model")
# a draft model's token in ScheduledSeq.draft: the runner fills it on the device (engine/draft.py)
DEVICE_DRAFT = -1


class SpeculativeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings, as vLLM's speculative_config: n-gram drafts (scheduler/ngram.py)
    {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M},
    or a draft model's (engine/draft.py) {"model": folder, "num_speculative_tokens": K}, its method
    "draft_model" where a model is given."""
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"
    model: str | None = None  # the draft model's folder (or preset name, with dummy weights)

    @classmethod
    def from_dict(cls, d: Any) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise SpeculativeConfigError(f"speculative_config must be a JSON object; got {d!r}")
        method = d.get("method", "draft_model" if "model" in d else "ngram")
        if method not in SPECULATIVE_METHODS:
            raise SpeculativeConfigError(f"speculative_config method {method!r} is not supported "
                                         f"(only {', '.join(SPECULATIVE_METHODS)})")
        keys = {"method", "num_speculative_tokens"} | (
            {"prompt_lookup_max", "prompt_lookup_min"} if method == "ngram" else {"model", "draft_tensor_parallel_size"})
        unknown = sorted(set(d) - keys)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unknown key {unknown[0]!r} for method {method} "
                                         f"({', '.join(sorted(keys))})")
        if "num_speculative_tokens" not in d:
            raise SpeculativeConfigError("speculative_config needs num_speculative_tokens (the draft's length, e.g. 4)")
        if method == "draft_model":
            model = d.get("model")
            if not isinstance(model, str) or not model:
                raise SpeculativeConfigError("speculative_config method draft_model needs \"model\": the draft "
                                             f"model's folder; got {model!r}")
            if d.get("draft_tensor_parallel_size", 1) != 1:
                raise SpeculativeConfigError("speculative_config draft_tensor_parallel_size must be 1: the draft model "
                                             "runs whole on the first GPU")
            return cls(d["num_speculative_tokens"], method=method, model=model)
        hi, lo = d.get("prompt_lookup_max"), d.get("prompt_lookup_min")
        if hi is None:  # one bound given: the other's default moves to keep min <= max
            hi = max(cls.prompt_lookup_max, lo) if isinstance(lo, int) else cls.prompt_lookup_max
        if lo is None:
            lo = min(cls.prompt_lookup_min, hi) if isinstance(hi, int) else cls.prompt_lookup_min
        return cls(d["num_speculative_tokens"], hi, lo)

    def __post_init__(self) -> None:
        for name, top in (("num_speculative_tokens", 16), ("prompt_lookup_max", 64), ("prompt_lookup_min", 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                raise SpeculativeConfigError(f"speculative_config {name} must be an integer from 1 to {top}; got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                                         f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise SpeculativeConfigError("speculative_config: a draft model goes with method draft_model")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


def next_seq_id() -> int:
    return next(_seq_ids)


@dataclass(eq=False)
class Sequence:
    """One request's tokens and KV-cache bookkeeping.

    token_ids holds the prompt followed by the generated tokens. num_computed_tokens counts the
    tokens whose K/V are in the cache; block_table lists the cache blocks, in order.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache or being written by a scheduled step
    num_pending: int = 0  # tokens sampled by steps in flight, not yet known here (async scheduling)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # params.prompt_logprobs: filled chunk by chunk until the first output token takes them
    # (take_prompt_logprobs)
    prompt_logprobs: PromptLogprobs | None = None
    # params.pooling: the pooled final hidden state so far (a sum for mean), until the first output
    # token takes it (take_embedding)
    pooled: array | None = None
    # speculative decoding's draft model (engine/draft.py): the positions whose KV it has written, and
    # the block table they were written under (a preempted sequence's new table starts it over)
    draft_kv: tuple[list[int], int] | None = None
    num_prompt_tokens: int = field(init=False)  # a plain attribute: read several times per sequence and step
    hash_root: int | None = field(init=False)  # the prefix cache's chain starts here (its LoRA adapter's)

    def __post_init__(self) -> None:
        self.hash_root = lora_root(self.params.lora)
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_total_tokens(self) -> int:
        """Known tokens plus those a step in flight is sampling: what the next step continues from."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_total_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not yet handed out: every prompt token is computed."""
        return self.params.prompt_logprobs is not None and len(self.token_ids) == self.num_prompt_tokens

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position's hidden state is needed (prompt logprobs, mean or first-token
        pooling): nothing is read from the prefix cache."""
        return (self.wants_prompt_logprobs or self.params.pooling in ("mean", "cls")) and \
            len(self.token_ids) == self.num_prompt_tokens

    def add_pooled(self, start: int, chunk: array) -> None:
        """A prompt chunk's share of the pooled state (from position start): its rows' sum for mean,
        the prompt's first or last row where the chunk holds it. A chunk from 0 starts over (a
        preempted prompt is computed again)."""
        if self.params.pooling == "mean" and start > 0 and self.pooled is not None:
            self.pooled = array("f", (a + b for a, b in zip(self.pooled, chunk)))
        else:
            self.pooled = chunk

    def take_embedding(self) -> array | None:
        """The pooled final hidden state (not normalized), once, with the first output token."""
        pooled, self.pooled = self.pooled, None
        if pooled is None or self.params.pooling != "mean":
            return pooled
        scale = 1.0 / self.num_prompt_tokens
        return array("f", (v * scale for v in pooled))

    def add_prompt_logprobs(self, start: int, chunk: PromptChunk) -> None:
        """The logprobs of prompt tokens start + 1, start + 2, ... (a chunk from position start)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = PromptLogprobs(self.prompt_token_ids, self.params.prompt_logprobs or 0)
        self.prompt_logprobs.fill(start + 1, chunk)

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt's logprobs, once, with the first output token."""
        if self.params.prompt_logprobs is None:
            return None
        out = self.prompt_logprobs or PromptLogprobs(self.prompt_token_ids, self.params.prompt_logprobs)
        self.prompt_logprobs = None
        return out

    def last_by_length(self) -> bool:
        """True when the pending token ends the sequence by max_tokens or the context length, so
        no further step needs to be scheduled for it."""
        total = len(self.token_ids) + self.num_pending
        max_tokens = self.params.max_tokens
        if max_tokens is not None and total - self.num_prompt_tokens >= max_tokens:
            return True
        return self.max_model_len is not None and total >= self.max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold in the cache."""
        limit = self.num_prompt_tokens + (self.params.max_tokens if self.params.max_tokens is not None else 10**12)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        return limit


@dataclass(init=False, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: num_new_tokens tokens starting at position start, up to
    end. samples: the chunk reaches the sequence's last token (as of scheduling), so the step
    yields a new token for it. Built for every sequence of every step: slots, a plain __init__."""

    seq: Sequence
    start: int
    num_new_tokens: int
    end: int
    samples: bool
    # speculative decoding: tokens proposed to follow the sequence's last one, verified in this step
    # (its input is that token and the draft; each position samples, and the tokens that match the
    # draft plus the next one are kept)
    draft: list[int] | None

    def __init__(self, seq: Sequence, start: int, num_new_tokens: int, draft: list[int] | None = None) -> None:
        self.seq = seq
        self.start = start
        self.num_new_tokens = num_new_tokens
        self.end = end = start + num_new_tokens
        self.draft = draft
        self.samples = draft is not None or end == len(seq.token_ids) + seq.num_pending


@dataclass
class Batch:
    """The work of one model step. Items with one new token (decodes) come first. num_steps > 1
    (a decode-only batch, SchedulerConfig.num_scheduler_steps): the step runs num_steps times back
    to back, each time on the tokens the last one sampled, so every item yields num_steps tokens."""

    items: list[ScheduledSeq]
    num_decode: int
    num_steps: int = 1
    # host-tier copies the runner does before this step's forward (kvcache/host_tier.py); None: none
    kv_moves: KVMoves | None = None

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new_tokens for it in self.items)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.items)

    @property
    def has_drafts(self) -> bool:
        return any(it.draft is not None for it in self.items[self.num_decode:])


class ExecutorLost(RuntimeError):
    """The executor can run no more steps (a tensor-parallel rank died, or the ranks fell out of
    step): every request fails with this message, and the engine stops."""


def describe_exit(code: int | None) -> str:
    """A process's exit code in words (an engine process, a tensor-parallel rank)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + how many tokens are more likely (prompt logprobs)


@dataclass(slots=True)
class PromptChunk:
    """Prompt logprobs of consecutive prompt tokens, as the runner hands them over: compact arrays
    (array.array: float32 'f', int64 'q'), not an object per token. top_*: k entries a token, flat."""
    logprobs: array
    ranks: array
    top_ids: array
    top_vals: array


class PromptLogprobs:
    """A prompt's logprobs (SamplingParams.prompt_logprobs), kept as arrays: row j for prompt token j.
    Reads like a list of TokenLogprob | None (None for the first token, which nothing predicts, and
    for a row never filled); each entry is built when read, in the API process rather than the engine's."""

    def __init__(self, token_ids: list[int], k: int) -> None:
        n = len(token_ids)
        self.token_ids = token_ids
        self.k = k
        self.logprobs = array("f", bytes(4 * n))
        self.ranks = array("q", bytes(8 * n))
        self.top_ids = array("q", bytes(8 * n * k))
        self.top_vals = array("f", bytes(4 * n * k))
        self.filled = bytearray(n)

    def fill(self, at: int, chunk: PromptChunk) -> None:
        """Rows at, at + 1, ... from chunk (a row computed again, after a preemption, is overwritten)."""
        c, k = len(chunk.logprobs), self.k
        assert len(chunk.top_ids) == len(chunk.top_vals) == c * k, "a chunk of another top-k width"
        self.logprobs[at:at + c] = chunk.logprobs
        self.ranks[at:at + c] = chunk.ranks
        self.top_ids[at * k:(at + c) * k] = chunk.top_ids
        self.top_vals[at * k:(at + c) * k] = chunk.top_vals
        self.filled[at:at + c] = b"\x01" * c

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, j: int | slice) -> TokenLogprob | None | list[TokenLogprob | None]:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        if j < 0:
            j += len(self)
        if not self.filled[j]:
            return None
        k = self.k
        top = list(zip(self.top_ids[j * k:(j + 1) * k], self.top_vals[j * k:(j + 1) * k]))
        return TokenLogprob(self.token_ids[j], self.logprobs[j], top, self.ranks[j])

    def __iter__(self) -> Iterator[TokenLogprob | None]:
        return (self[j] for j in range(len(self)))


@dataclass(slots=True)
class SampleOutput:
    """What the executor returns for an item that samples, or (token_id -1) for a prefill chunk
    that samples nothing but has prompt logprobs."""

    token_id: int
    logprob: TokenLogprob | None = None
    more: list[int] | None = None  # a multi-step batch's later tokens, in order
    prompt: PromptChunk | None = None  # the chunk's prompt logprobs (SamplingParams.prompt_logprobs)
    pooled: array | None = None  # the chunk's share of SamplingParams.pooling (Sequence.add_pooled)


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request; text fields are filled by the detokenizer.
    Made for every sequence of every step: slots make that several times cheaper."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    new_text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with the first output token, where asked for
    embedding: array | None = None  # SamplingParams.pooling's pooled hidden state, with the first output token
