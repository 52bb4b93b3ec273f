"""Summary statistics of a run, as vLLM's benchmark_serving reports them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; a request is good when it meets every one set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> "SLO | None":
        """From --goodput items like "ttft:500" "tpot:50"; None when no item is given."""
        if not items:
            return None
        values: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"--goodput takes KEY:MS items with KEY one of {', '.join(SLO_KEYS)}; got {item!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
            if not ms > 0:
                raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
            values[f"{key}_ms"] = ms
        return cls(**values)

    def met_by(self, r: RequestResult) -> bool:
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2el_ms, r.e2el_s))
        # a single-token request has no TPOT: it can't miss a TPOT objective
        return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2el_ms", self.e2el_ms))
                if v is not None}


@dataclass(frozen=True)
class Distribution:
    """mean, median, p90 and p99 in milliseconds; all None when there is no sample."""

    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: list[float]) -> "Distribution":
        if not values:
            return cls(None, None, None, None)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(ms, [50, 90, 99]).tolist()
        return cls(float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # good requests per second; None without an SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    chunk_gap: Distribution  # between consecutive token-carrying chunks of a stream
    errors: dict[str, int]  # error message -> how many requests failed with it


def compute_metrics(results: list[RequestResult], duration_s: float, slo: SLO | None = None) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_throughput=total_out * per_s,
        total_token_throughput=(total_in + total_out) * per_s,
        goodput=None if slo is None else sum(slo.met_by(r) for r in ok) * per_s,
        ttft=Distribution.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Distribution.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=Distribution.of_seconds([x for r in ok for x in r.itls_s()]),
        e2el=Distribution.of_seconds([r.e2el_s for r in ok]),
        chunk_gap=Distribution.of_seconds([x for r in ok for x in r.chunk_gaps_s()]),
        errors=errors,
    )


@dataclass(frozen=True)
class TurnSplit:
    """A multi-turn run's TTFT, first turns apart from follow-up turns (whose prompts repeat the
    conversation so far: what a prefix cache, and its host tier, serve)."""

    first_ttft: Distribution
    follow_up_ttft: Distribution
    first_prompt_tokens: int  # mean, successful requests
    follow_up_prompt_tokens: int

    @classmethod
    def of(cls, results: list[RequestResult]) -> "TurnSplit":
        ok = [r for r in results if r.success]
        first = [r for r in ok if r.turn == 0]
        later = [r for r in ok if r.turn > 0]

        def mean_len(rs: list[RequestResult]) -> int:
            return round(sum(r.prompt_len for r in rs) / len(rs)) if rs else 0

        return cls(Distribution.of_seconds([r.ttft_s for r in first if r.ttft_s is not None]),
                   Distribution.of_seconds([r.ttft_s for r in later if r.ttft_s is not None]),
                   mean_len(first), mean_len(later))
