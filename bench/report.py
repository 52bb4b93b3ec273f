"""The run's report: the text table printed at the end, and the result JSON."""
from __future__ import annotations

from dataclasses import dataclass

from bench.client import RequestResult
from bench.metrics import SLO, BenchmarkMetrics, Distribution, TurnSplit
from bench.roofline import HardwareRates, RooflineEstimate
from bench.workload import WorkloadSpec

WIDTH = 50


@dataclass(frozen=True)
class RunInfo:
    """What was run, where: the header of the result."""

    date: str  # ISO 8601
    model: str | None  # the model folder or preset given with --model
    served_model_name: str
    url: str
    gpu: str | None
    workload: WorkloadSpec
    concurrency: int | None
    request_rate: float | None  # None: all requests at once
    ignore_eos: bool
    kv_cache_dtype: str
    server_args: str | None = None  # when the run started its own server
    temperature: float = 0.0
    top_p: float = 1.0
    extra_body: dict | None = None  # --extra-body
    prompt_format: str = "ids"  # ids: token ids; text: text the server tokenizes
    num_turns: int = 1  # > 1: a multi-turn run of workload.num_prompts conversations (--multi-turn)
    turn_len: int = 0  # new tokens per follow-up turn


@dataclass(frozen=True)
class Roofline:
    estimate: RooflineEstimate
    rates: HardwareRates  # of all the GPUs the model is split over together
    num_gpus: int = 1
    at_burst_rate: RooflineEstimate | None = None  # the same bounds at the cold GPU's matmul rate

    def fraction(self, output_throughput: float) -> float:
        """Of the physical bound (compute and memory overlapped)."""
        return output_throughput / self.estimate.output_throughput

    def serial_fraction(self, output_throughput: float) -> float:
        return output_throughput / self.estimate.serial_output_throughput

    def burst_fractions(self, output_throughput: float) -> tuple[float, float] | None:
        """(physical, serial) fractions of the bounds at a cold GPU's matmul rate, as figures before
        2026-11-27 were measured; None where that rate is unknown."""
        cold = self.at_burst_rate
        if cold is None or not self.rates.matmul_flops_burst:
            return None
        return output_throughput / cold.output_throughput, output_throughput / cold.serial_output_throughput


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def result_dict(info: RunInfo, metrics: BenchmarkMetrics, results: list[RequestResult],
                roofline: Roofline | None, slo: SLO | None, gpu_power: list[dict] | None = None) -> dict:
    """gpu_power: bench/gpu_monitor.py's summary of the run, where its GPUs were sampled."""
    w = info.workload
    out = {
        "date": info.date,
        "gpu": info.gpu,
        "model": info.model or info.served_model_name,
        "served_model_name": info.served_model_name,
        "url": info.url,
        "server_args": info.server_args,
        "concurrency": info.concurrency,
        "request_rate": info.request_rate,
        "num_prompts": w.num_prompts,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "range_ratio": w.range_ratio,
        "shared_prefix_len": w.shared_prefix_len,
        "ignore_eos": info.ignore_eos,
        "temperature": info.temperature,
        "top_p": info.top_p,
        "extra_body": info.extra_body,
        "prompt_format": info.prompt_format,
        "seed": w.seed,
        "kv_cache_dtype": info.kv_cache_dtype,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "errors": metrics.errors,
        "duration_s": metrics.duration_s,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "goodput": metrics.goodput,
        "slo": slo.as_dict() if slo else None,
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        dist: Distribution = getattr(metrics, name)
        for stat in ("mean", "median", "p90", "p99"):
            out[f"{stat}_{name}_ms"] = getattr(dist, stat)
    if info.num_turns > 1:
        out.update(multi_turn_dict(info, TurnSplit.of(results)))
    out["median_chunk_gap_ms"] = metrics.chunk_gap.median
    out["p99_chunk_gap_ms"] = metrics.chunk_gap.p99
    est = roofline.estimate if roofline else None
    cold = roofline.burst_fractions(metrics.output_throughput) if roofline else None
    out.update({
        "roofline_num_gpus": roofline.num_gpus if roofline else None,
        "copy_bandwidth_tbs": roofline.rates.copy_bandwidth / 1e12 if roofline else None,
        "matmul_tflops": roofline.rates.matmul_flops / 1e12 if roofline else None,
        "roofline_output_throughput": est.output_throughput if est else None,
        "roofline_fraction": roofline.fraction(metrics.output_throughput) if roofline else None,
        "serial_bound_output_throughput": est.serial_output_throughput if est else None,
        "serial_bound_fraction": roofline.serial_fraction(metrics.output_throughput) if roofline else None,
        "roofline_compute_s": est.compute_s if est else None,
        "roofline_memory_s": est.memory_s if est else None,
        "roofline_prefill_s": est.prefill_s if est else None,
        "roofline_decode_s": est.decode_s if est else None,
        "roofline_decode_step_ms": est.decode_step_s * 1000.0 if est else None,
        "matmul_tflops_burst": roofline.rates.matmul_flops_burst / 1e12 if cold else None,
        "roofline_fraction_at_burst_rate": cold[0] if cold else None,
        "serial_bound_fraction_at_burst_rate": cold[1] if cold else None,
    })
    out["gpu_power"] = gpu_power
    out["requests"] = [
        {"start_s": r.start_s, "prompt_tokens": r.prompt_len, "output_tokens": r.output_tokens,
         "ttft_ms": _ms(r.ttft_s), "tpot_ms": _ms(r.tpot_s), "e2el_ms": _ms(r.e2el_s) if r.success else None,
         "error": r.error or None, **({"conversation": r.conversation, "turn": r.turn} if info.num_turns > 1 else {})}
        for r in results
    ]
    return out


def multi_turn_dict(info: RunInfo, split: TurnSplit) -> dict:
    first, later = split.first_ttft, split.follow_up_ttft
    return {
        "multi_turn": True, "num_conversations": info.workload.num_prompts, "num_turns": info.num_turns,
        "turn_len": info.turn_len,
        "mean_first_turn_prompt_tokens": split.first_prompt_tokens,
        "mean_follow_up_prompt_tokens": split.follow_up_prompt_tokens,
        "median_first_turn_ttft_ms": first.median, "p99_first_turn_ttft_ms": first.p99,
        "median_follow_up_ttft_ms": later.median, "p99_follow_up_ttft_ms": later.p99,
        "mean_follow_up_ttft_ms": later.mean,
    }


def _row(label: str, value: object, digits: int = 2) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:,.{digits}f}"
    else:
        text = str(value)
    return f"{label:<{WIDTH - 12}}{text:>12}"


def _title(text: str, fill: str = "-") -> str:
    return f" {text} ".center(WIDTH, fill)


def format_report(info: RunInfo, metrics: BenchmarkMetrics, roofline: Roofline | None,
                  no_roofline_reason: str = "", split: TurnSplit | None = None,
                  gpu_power: list[dict] | None = None) -> str:
    """split: a multi-turn run's first and follow-up turns (TurnSplit.of), reported apart;
    gpu_power: bench/gpu_monitor.py's summary of the run."""
    lines = [
        _title("Serving Benchmark Result", "="),
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
        _row("Maximum request concurrency:", info.concurrency or "unlimited"),
        _row("Request rate (req/s):", info.request_rate if info.request_rate is not None else "inf"),
        _row("Benchmark duration (s):", metrics.duration_s),
        _row("Total input tokens:", metrics.total_input_tokens),
        _row("Total generated tokens:", metrics.total_output_tokens),
        _row("Request throughput (req/s):", metrics.request_throughput),
        _row("Output token throughput (tok/s):", metrics.output_throughput),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    if metrics.goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.goodput))
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        dist: Distribution = getattr(metrics, name)
        label = name.upper()
        lines += [
            _title(title),
            _row(f"Mean {label} (ms):", dist.mean),
            _row(f"Median {label} (ms):", dist.median),
            _row(f"P90 {label} (ms):", dist.p90),
            _row(f"P99 {label} (ms):", dist.p99),
        ]
    if split is not None:
        lines += [
            _title(f"Multi-turn: {info.workload.num_prompts} conversations x {info.num_turns} turns"),
            _row("Mean first-turn prompt (tokens):", split.first_prompt_tokens),
            _row("Mean follow-up prompt (tokens):", split.follow_up_prompt_tokens),
            _row("Median first-turn TTFT (ms):", split.first_ttft.median),
            _row("P99 first-turn TTFT (ms):", split.first_ttft.p99),
            _row("Median follow-up TTFT (ms):", split.follow_up_ttft.median),
            _row("P99 follow-up TTFT (ms):", split.follow_up_ttft.p99),
        ]
    lines += [_row("Median chunk gap (ms):", metrics.chunk_gap.median),
              _row("P99 chunk gap (ms):", metrics.chunk_gap.p99)]
    lines.append(_title("Roofline"))
    lines.append(_row("GPU:", info.gpu or "n/a"))
    if roofline is None:
        lines.append(_row("Roofline bound:", "n/a"))
        if no_roofline_reason:
            lines.append(f"  ({no_roofline_reason})")
    else:
        est = roofline.estimate
        step_ms = est.decode_step_s * 1000.0
        if roofline.num_gpus > 1:
            lines.append(_row("Roofline GPUs (rates summed):", roofline.num_gpus))
        lines += [
            _row("Copy bandwidth (TB/s):", roofline.rates.copy_bandwidth / 1e12),
            _row("Matmul rate, sustained (TFLOP/s):", roofline.rates.matmul_flops / 1e12,
                 0 if roofline.rates.matmul_flops >= 1e14 else 2),
            _row("Physical bound (tok/s):", est.output_throughput),
            _row("Fraction of physical bound:", roofline.fraction(metrics.output_throughput), 3),
            _row("Serial bound (tok/s):", est.serial_output_throughput),
            _row("Fraction of serial bound:", roofline.serial_fraction(metrics.output_throughput), 3),
            _row("Roofline decode step (ms):", step_ms, 3),
            _row("P99 chunk gap / roofline step:",
                 metrics.chunk_gap.p99 / step_ms if metrics.chunk_gap.p99 is not None and step_ms > 0 else None),
            _row("Median TPOT / roofline step:",
                 metrics.tpot.median / step_ms if metrics.tpot.median is not None and step_ms > 0 else None),
        ]
        cold = roofline.burst_fractions(metrics.output_throughput)
        if cold is not None:
            burst = roofline.rates.matmul_flops_burst / 1e12
            lines += [_row("Matmul rate, cold burst (TFLOP/s):", burst, 0 if burst >= 100 else 2),
                      _row("Fractions at the burst rate:", f"{cold[0]:.3f} / {cold[1]:.3f}")]
    for gpu in gpu_power or []:
        lines += [_row(f"GPU {gpu['index']} SM clock, median (MHz):", float(gpu["sm_mhz_median"]), 0),
                  _row(f"GPU {gpu['index']} samples at the power cap:", gpu["power_capped_fraction"], 2)]
    if metrics.errors:
        lines.append(_title("Errors"))
        lines += [f"{n:>5} x {msg}" for msg, n in sorted(metrics.errors.items(), key=lambda kv: -kv[1])]
    lines.append("=" * WIDTH)
    return "\n".join(lines)
