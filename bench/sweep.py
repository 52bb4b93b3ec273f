"""`serve bench --request-rate R1,R2,...`: one run per rate, then goodput against the offered rate.

Goodput is the requests per second that met every --goodput objective; past saturation the queue
grows, TTFT with it, and goodput falls while throughput stays flat: the rate where it peaks is what
a deployment can promise under those objectives. Each run sends the same lengths with fresh
tokens (bench/workload.py fresh_tokens), so no run is helped by an earlier one's prefix cache.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from bench.load import LoadResult
from bench.metrics import SLO, BenchmarkMetrics
from bench.report import Roofline, RunInfo, result_dict
from bench.workload import BenchRequest


@dataclass(frozen=True)
class Measured:
    """One run: what bench/cli.py measured at one rate."""

    load: LoadResult
    metrics: BenchmarkMetrics
    roofline: Roofline | None
    info: RunInfo
    gpu_power: list[dict] | None = None  # bench/gpu_monitor.py's summary of the run, where sampled


@dataclass(frozen=True)
class SweepPoint:
    """One rate's row of the goodput table. Latencies in ms."""

    request_rate: float | None  # offered; None: every request at once
    completed: int
    failed: int
    request_throughput: float
    goodput: float | None  # None without objectives
    good_fraction: float | None  # of the requests sent
    output_throughput: float
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    median_tpot_ms: float | None
    p99_tpot_ms: float | None
    p99_itl_ms: float | None

    @classmethod
    def of(cls, rate: float | None, m: BenchmarkMetrics, slo: SLO | None, results: list[Any]) -> "SweepPoint":
        sent = m.completed + m.failed
        good = None
        if slo is not None and sent:
            good = sum(1 for r in results if r.success and slo.met_by(r)) / sent
        return cls(rate, m.completed, m.failed, m.request_throughput, m.goodput, good, m.output_throughput,
                   m.ttft.median, m.ttft.p99, m.tpot.median, m.tpot.p99, m.itl.p99)


def best_rate(points: list[SweepPoint]) -> SweepPoint | None:
    """The point of the highest goodput (the lowest rate among equals); None without objectives."""
    scored = [p for p in points if p.goodput is not None]
    return max(scored, key=lambda p: (p.goodput, -(p.request_rate or math.inf))) if scored else None


def _cell(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def format_table(points: list[SweepPoint], slo: SLO | None) -> str:
    """The console table: one row per rate."""
    head = ("rate req/s", "done", "fail", "req/s", "goodput", "good %", "out tok/s", "TTFT p50", "TTFT p99",
            "TPOT p50", "TPOT p99")
    rows = [head]
    for p in points:
        rows.append(("inf" if p.request_rate is None else f"{p.request_rate:g}", str(p.completed), str(p.failed),
                     _cell(p.request_throughput, 2), _cell(p.goodput, 2),
                     "n/a" if p.good_fraction is None else f"{p.good_fraction:.0%}", _cell(p.output_throughput, 0),
                     _cell(p.median_ttft_ms), _cell(p.p99_ttft_ms), _cell(p.median_tpot_ms), _cell(p.p99_tpot_ms)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [" Goodput vs request rate ".center(sum(widths) + 2 * len(widths), "="),
             f"objectives: {', '.join(f'{k} <= {v:g}' for k, v in slo.as_dict().items())}" if slo
             else "objectives: none (pass --goodput, e.g. --goodput ttft:500 tpot:50)"]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    best = best_rate(points)
    if best is not None:
        lines.append(f"best goodput: {best.goodput:,.2f} req/s at "
                     f"{'inf' if best.request_rate is None else f'{best.request_rate:g}'} req/s offered")
    lines.append("latencies in ms")
    return "\n".join(lines)


def sweep_dict(runs: list[Measured], points: list[SweepPoint], slo: SLO | None) -> dict:
    """The result JSON of a sweep: the table, then each run's full result (bench/report.py)."""
    first = runs[0].info
    return {
        "date": first.date, "gpu": first.gpu, "model": first.model or first.served_model_name,
        "served_model_name": first.served_model_name, "url": first.url, "server_args": first.server_args,
        "slo": slo.as_dict() if slo else None,
        "request_rates": [p.request_rate for p in points],
        "goodput_table": [asdict(p) for p in points],
        "best": asdict(best) if (best := best_rate(points)) else None,
        "runs": [result_dict(r.info, r.metrics, r.load.results, r.roofline, slo, r.gpu_power) for r in runs],
    }


def run_sweep(rates: list[float | None], requests_for: Callable[[int], list[BenchRequest]],
              measure: Callable[[float | None, list[BenchRequest]], Measured], slo: SLO | None,
              report: Callable[[str], None]) -> tuple[list[Measured], list[SweepPoint]]:
    """Measure each rate in turn (requests_for(i): run i's requests); report(line) after each run."""
    runs, points = [], []
    for i, rate in enumerate(rates):
        run = measure(rate, requests_for(i))
        point = SweepPoint.of(rate, run.metrics, slo, run.load.results)
        runs.append(run)
        points.append(point)
        report(f"rate {'inf' if rate is None else f'{rate:g}'} req/s: {point.completed} done, {point.failed} failed, "
               f"{point.request_throughput:.2f} req/s" + ("" if point.goodput is None else
                                                         f", goodput {point.goodput:.2f} req/s"))
    return runs, points
