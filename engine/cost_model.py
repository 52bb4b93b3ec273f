"""How long a step takes on this GPU, measured at start-up, and how many prompt tokens a step may
carry beside its decodes without stalling them (stall-free batching).

A step's matmuls read every weight once, whatever the step carries: at the roofline a step of N
rows (decode rows + prompt tokens) costs what a step of one row costs up to the ridge point, and
grows with N beyond it. The measured curve is steeper and not even monotonic: cuBLAS picks its
kernel by shape, and on an H100 a Llama-3-8B forward of 832 rows took 21.0 ms where 1,024 took 19.0
(bench/NOTES.md, 2026-11-26). Steps with prompt tokens replay CUDA graphs captured at a few token
counts (buckets) and pay for the whole bucket, so `forward_ms` holds the device time of a forward at
each bucket (prompt chunks of at most CHUNK tokens, so that attention stays a small part; the
compute-bound ones timed with the GPU at its power limit, as a served run holds it), and a
bucket that a larger one beats is dropped: a step pads past it to the cheaper one. Decode attention
adds the read of every context token's K and V, at the measured copy bandwidth.

The scheduler asks `prompt_budget(decodes, context_tokens, demand)`: the prompt tokens that fill the
largest bucket within the latency target, which is the user's max_step_ms, or else a forward of
STALL_FACTOR times the decodes' own (their attention comes on top either way), or longer where a
larger step carries prompt tokens far more cheaply per token (AMORTIZE: a curve with a large fixed
part past the decode rows, as 4-bit weights' dequantization gives). With no decode
running the budget is the whole step (a lone prompt runs at full speed: nothing streams that it
could stall). Without a user's target, the steps of one GPU also take the backlog of waiting
prompts (demand: the prompt tokens a step needs for every sequence that could run to be decoding)
where the stall factor allows less. On a steep curve the factor alone admits prompts only as fast
as the few running decodes end: Llama-3-8B with 4-bit weights on an H200 (16 rows 2.9 ms, 128 rows
7.6) held a dozen decodes at 64 clients, prompts ~50 tokens a step, median TTFT 2.6 s; with the
backlog it served 1.65x the tokens/s (bench/NOTES.md, 2026-11-28 and 2026-11-29). A backlog is an
overload: the streams then pay for the step the waiting prompts need.

A pipeline stage (pipelined) runs each scheduling round as several micro-batches, each reading the
stage's weights once. Prompt tokens within that read's time ride in a micro-batch for free; beyond
it they cost their compute wherever they go. While the cache is what holds prompts back (the
scheduler passes `demand`: it admits a prompt only as a sequence ends, and the workload needs about
that many prompt tokens a step), a large budget takes the prompts of the sequences that ended
together in a few micro-batches and leaves the rest with none, paying for their compute on top of
every read, and the sequences stay in step with each other. There each step takes the larger of
the ridge (`ridge_rows`: the largest bucket whose rows, at the largest bucket's compute-bound time
per row, take no longer than reading the weights) and the demand: prompts then go in at the rate
the sequences end, spread over the micro-batches. Where prompts wait for compute instead, the
stall factor's larger steps admit them faster (lab/sim.py --stages; bench/NOTES.md, 2026-11-27).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# a mixed step's forward may take this many times its decodes' own (unless max_step_ms says): with
# the matmuls measured on H100/H200 (2026-11-25) larger prompt chunks cost less per token, smaller
# ones stall the streams less (bench/NOTES.md)
STALL_FACTOR = 2.5
# prompt tokens beside decodes may cost this much more per token than where a step carries them most
# cheaply. A curve with a large fixed part past the decode rows (4-bit weights: every projection's
# weight dequantized for a prompt step) charges a small prompt step that part in full. On an H200
# the 4-bit Llama-3-8B's steps of 64 decodes grew from 384 rows (the backlog's) to 896 and served
# 1.15x the tokens/s at 64 clients (1.24x at 32), median TPOT 11.7 against 13.8 ms (bench/NOTES.md,
# 2026-11-29). Tighter, the measured curves' noise (a few % a bucket) reaches bf16's and FP8's steps
AMORTIZE = 1.25
MIN_PROMPT_TOKENS = 16  # prompts always advance, whatever the target
CHUNK = 256  # tokens per prompt chunk in the measured forwards
MAX_ROWS = 2048  # the largest forward measured
# the engine loop's host work per scheduling round (schedule, launch, process, send), measured
# 0.6-1.2 ms a step on H100 hosts (bench/NOTES.md, 2026-11-24); multi-step rounds pay it once for K steps
HOST_STEP_MS = 1.0
# a forward shorter than this is paced by the host: whole-step graphs pay there
HOST_BOUND_MS = 4 * HOST_STEP_MS
# a decode forward shorter than this takes multi-step rounds (and no prompt budget). Between 2 and
# 4 ms single steps served as much and far more evenly: Llama-3-8B with FP8 weights on an H200
# (decode forward ~3.9 ms) 0.98x the tokens/s of 4-step rounds, median TTFT 52 against 292 ms, p99
# chunk gap 11 against 123 ms; Llama-3-8B at TP=2 (3.8 ms) had the same stalls (bench/NOTES.md,
# 2026-11-26 and 2026-11-28). Qwen2.5-0.5B's ~1.1 ms keeps its rounds.
MULTI_STEP_MS = 2 * HOST_STEP_MS


@dataclass(frozen=True)
class StepCostModel:
    rows: tuple[int, ...]  # forward sizes measured (the buckets steps run at), ascending
    forward_ms: tuple[float, ...]  # device time of each
    kv_ms_per_token: float  # reading one context token's K and V in every layer
    max_tokens: int  # the most tokens a step may carry (max_num_batched_tokens)
    max_step_ms: float | None = None  # the user's target; None: stall_factor x the decodes' own forward
    stall_factor: float = STALL_FACTOR
    pipelined: bool = False  # a pipeline stage's: steps to the ridge or the demand while the cache binds (above)
    buckets: tuple[int, ...] = field(init=False)  # the sizes no larger one beats, ascending
    bucket_ms: tuple[float, ...] = field(init=False)  # their times, strictly increasing
    _amortized: dict[int, int] = field(init=False, repr=False, compare=False)  # amortizing_rows by decodes

    @classmethod
    def roofline(cls, rows: list[int], weight_bytes: int, flops_per_row: float, kv_bytes_per_token: int,
                 copy_bandwidth: float, matmul_flops: float, max_tokens: int) -> "StepCostModel":
        """The model a GPU at its roofline would measure: a forward of r rows takes the longer of
        reading the weights once and its matmuls (`serve kv-calc` predicts the engine's choices
        from it where it cannot measure)."""
        ms = [max(weight_bytes / copy_bandwidth, flops_per_row * r / matmul_flops) * 1e3 for r in rows]
        return cls(tuple(rows), tuple(ms), kv_bytes_per_token / copy_bandwidth * 1e3, max_tokens)

    def __post_init__(self) -> None:
        if len(self.rows) < 2 or len(self.rows) != len(self.forward_ms) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError("the cost model needs two or more forward sizes, ascending")
        kept: list[tuple[int, float]] = []
        for r, ms in zip(reversed(self.rows), reversed(self.forward_ms)):
            if not kept or ms < kept[-1][1]:
                kept.append((r, ms))
        kept.reverse()
        object.__setattr__(self, "buckets", tuple(r for r, _ in kept))
        object.__setattr__(self, "bucket_ms", tuple(ms for _, ms in kept))
        object.__setattr__(self, "_amortized", {})

    @property
    def dominated(self) -> frozenset[int]:
        """Measured sizes that a larger one beats: graphs need not be captured there."""
        return frozenset(self.rows) - frozenset(self.buckets)

    def _slope(self) -> float:
        """ms per row beyond the largest bucket: the last two buckets' (the steepest part), at least
        the largest bucket's mean per row. Two neighbours timed a few % apart can be nearly level (an
        H100's Llama-3-8B: 1,920 rows 46.88 ms, 2,048 rows 47.38, 3.9 us a row against ~23), and a
        step past the largest bucket would then look almost free."""
        per_row = self.bucket_ms[-1] / self.buckets[-1]
        if len(self.buckets) < 2:
            return per_row
        return max(per_row, (self.bucket_ms[-1] - self.bucket_ms[-2]) / (self.buckets[-1] - self.buckets[-2]))

    def forward(self, rows: int) -> float:
        """ms of a forward of `rows` rows: the smallest bucket that holds them; beyond the largest,
        its time plus _slope() a row."""
        b = self.buckets
        i = bisect.bisect_left(b, rows)
        if i < len(b):
            return self.bucket_ms[i]
        return self.bucket_ms[-1] + self._slope() * (rows - b[-1])

    def step_ms(self, decodes: int, context_tokens: int, prompt_tokens: int) -> float:
        """A step of `decodes` decode rows attending over `context_tokens` positions in all, and
        `prompt_tokens` prompt tokens."""
        return self.forward(decodes + prompt_tokens) + self.kv_ms_per_token * context_tokens

    def forward_limit_ms(self, decodes: int, context_tokens: int, demand: int | None = None) -> float:
        """How long the forward of a step with these decodes may take, prompt tokens included."""
        if self.max_step_ms is not None:
            return max(self.max_step_ms - self.kv_ms_per_token * context_tokens, self.forward(decodes))
        own = self.forward(decodes)
        if self.pipelined and demand is not None:
            paced = max(self.forward(self.ridge_rows()), self.forward(decodes + demand))
            return max(own, min(self.stall_factor * own, paced))
        limit = max(self.stall_factor * own, self.forward(self.amortizing_rows(decodes)))
        return limit if demand is None else max(limit, self.forward(decodes + demand))

    def amortizing_rows(self, decodes: int) -> int:
        """The rows of the smallest step with these decodes whose prompt tokens cost within AMORTIZE
        of the cheapest per token, among the buckets from the step the stall factor gives them (at
        least MIN_PROMPT_TOKENS) to the largest measured; that step itself where no larger one
        is cheaper per token by more than AMORTIZE."""
        rows = self._amortized.get(decodes)
        if rows is None:
            own = self.forward(decodes)
            first = max(self.rows_within(self.stall_factor * own), decodes + MIN_PROMPT_TOKENS)
            steps = [(r, (ms - own) / (r - decodes)) for r, ms in zip(self.buckets, self.bucket_ms) if r >= first]
            if steps:
                cap = AMORTIZE * min(c for _, c in steps)
                rows = next(r for r, c in steps if c <= cap)
            else:
                rows = first
            self._amortized[decodes] = rows
        return rows

    def ridge_rows(self) -> int:
        """The largest bucket whose rows, at the largest bucket's time per row (compute bound), take
        no longer than the smallest bucket's forward (the weights' read): up to it a step costs
        about that read."""
        rows = self.bucket_ms[0] / (self.bucket_ms[-1] / self.buckets[-1])
        return self.buckets[max(bisect.bisect_right(self.buckets, rows) - 1, 0)]

    def prompt_budget(self, decodes: int, context_tokens: int, demand: int | None = None) -> int:
        """The most prompt tokens a step of these decodes may carry: up to the largest bucket within
        the target, so that no row of it is padding. demand (None: no prompt waits): a pipeline
        stage's, the prompt tokens a step needs to keep pace with the sequences that end while
        prompts wait for cache blocks; one GPU's, the backlog (the scheduler's estimates)."""
        room = max(self.max_tokens - decodes, 0)
        if decodes == 0:
            return room
        rows = self.rows_within(self.forward_limit_ms(decodes, context_tokens, demand))
        return min(room, max(MIN_PROMPT_TOKENS, rows - decodes))

    def rows_within(self, ms: float) -> int:
        """The largest bucket whose forward takes at most `ms` (0 if none); beyond the largest
        bucket, the rows its slope allows."""
        i = bisect.bisect_right(self.bucket_ms, ms)
        if i == 0:
            return 0
        if i == len(self.buckets):
            slope = self._slope()
            extra = (ms - self.bucket_ms[-1]) / slope if slope > 0 else 0.0
            return self.buckets[-1] + int(extra)
        return self.buckets[i - 1]

    def largest_mixed_step(self, max_num_seqs: int) -> int:
        """Tokens of the largest step with decodes that the budget allows (the budget is largest
        with no context to read)."""
        return max(d + self.prompt_budget(d, 0) for d in range(1, max_num_seqs + 1))

    def scheduler_steps(self, decodes: int, auto_steps: int) -> int:
        """Decode steps per scheduling round: several where the host's per-round work is a large
        share of a decode step (a small model), one where the GPU step dwarfs it."""
        return auto_steps if self.forward(decodes) < MULTI_STEP_MS else 1

    def host_bound_rows(self) -> int:
        """The largest bucket whose forward takes less than HOST_BOUND_MS (0 if none): steps up to it
        are paced by the host's launches, which whole-step graphs save; beyond it the GPU sets the
        pace and a graph saves nothing."""
        i = bisect.bisect_left(self.bucket_ms, HOST_BOUND_MS)
        return self.buckets[i - 1] if i > 0 else 0
