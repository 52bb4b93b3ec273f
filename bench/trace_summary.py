"""Summarize a PAGEDSERVE_STEP_TRACE file (scheduler/trace.py): per kind of step, how the engine
loop's wall time splits into scheduling, launching, waiting for the previous step's tokens,
processing them and sending the outputs; on a GPU also each step's time on the device (gpu, from
CUDA events around the step) and how long the device sat idle before it (idle).

    python -m bench.trace_summary trace.jsonl [--json out.json] [--after-idle MS]
    python -m bench.trace_summary trace.jsonl --token-gaps [--decoding-engine]

--after-idle MS keeps only the steps after the last time the device sat idle for more than MS
(a serve bench run after its warm-up requests). Mixed and prefill steps also get a least-squares
fit of their device time against their prompt tokens (fixed ms per step + us per token).
--model (a folder, a config.json or a preset name, as serve bench takes) with the rates
(--bench-json, a serve bench result of the same run: its copy bandwidth, matmul rate and GPUs; or
--copy-bandwidth TB/s --matmul-tflops T): each kind of step's device time against its own bound,
each step's max(FLOPs / matmul rate, bytes / copy bandwidth) (bench/roofline.py's costs: every
weight once a model step, the KV the step reads and writes, 2 FLOPs a parameter a token and
attention over the positions it attends).
Over all steps, the device time against the sum of the steps' bounds (gpu_over_bound); with
--bench-json also the physical bound's time of that run (its output tokens at serve bench's
roofline_output_throughput) against the same sum (schedule_fraction): how much of the physical
bound the schedule leaves before any step runs slow, so that roofline_fraction is about
schedule_fraction / gpu_over_bound (less the device's idle time).
--token-gaps: how long a decoding row waits from one step to the next, as its client would see
the engine's side of the inter-token gap: each step's interval to the next, once per row it
carried; median, p90, p99. A disaggregated server's engines write one trace between them: with
--decoding-engine only the steps that carry decodes count (the decode engine's; a prefill engine
runs none).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

PHASES = (("schedule", "t0", "t_sched"), ("launch", "t_sched", "t_launch"), ("wait", "t_launch", "t_collect"),
          ("process", "t_collect", "t_end"), ("send", "t_end", "t_sent"))


def kind(row: dict) -> str:
    if "seqs" not in row:
        return "drain"  # no new batch: only collects the step in flight
    return "decode" if row["decodes"] == row["seqs"] else "prefill" if row["decodes"] == 0 else "mixed"


def _device_times(rows: list[dict]) -> list[dict]:
    """Rows with gpu_ms / idle_ms: a row's prev_* fields belong to the row before it (the step it
    collected, which that row launched). The engine process's rows of requests it took in (added)
    are left out: they are not steps."""
    rows = [dict(r) for r in rows if "added" not in r]
    for prev, row in zip(rows, rows[1:]):
        if "prev_gpu_ms" in row:
            prev["gpu_ms"], prev["idle_ms"] = row.pop("prev_gpu_ms"), row.pop("prev_idle_ms")
    return rows


def after_idle(rows: list[dict], ms: float) -> list[dict]:
    """The rows from the last one that had been idle for more than ms on the device (all if none);
    that wait, before the window, does not count."""
    starts = [i for i, r in enumerate(rows) if r.get("idle_ms", 0.0) > ms]
    if not starts:
        return rows
    return [{**rows[starts[-1]], "idle_ms": 0.0}] + rows[starts[-1] + 1:]


def _stats(vals: list[float]) -> dict:
    return {"mean": statistics.fmean(vals), "median": statistics.median(vals), "sum": sum(vals)}


def _fit(rs: list[dict]) -> dict | None:
    """gpu_ms = fixed + per_token * prompt tokens (the step's tokens beyond its decodes)."""
    rs = [r for r in rs if "gpu_ms" in r]
    tokens = [r["tokens"] - r["decodes"] for r in rs]
    if len(rs) < 3 or len(set(tokens)) < 2:
        return None
    slope, intercept = statistics.linear_regression(tokens, [r["gpu_ms"] for r in rs])
    return {"fixed_ms": intercept, "us_per_prompt_token": slope * 1e3}


def step_bound_ms(row: dict, cost, rates) -> float | None:
    """The step's device time at the roofline, ms (None for a row without the trace's attended and
    cached fields). A multi-step row runs its decodes `steps` times, each one position further."""
    if "attended" not in row:
        return None
    n = row.get("steps", 1)
    later = row["decodes"] * n * (n - 1) / 2  # positions the later model steps add
    tokens = row["tokens"] * n
    flops = 2.0 * cost.model.active_params() * tokens + cost.attention_flops(row["attended"] * n + later)
    nbytes = n * cost.step_weight_bytes(row["tokens"]) + (row["cached"] * n + later + tokens) * cost.kv_bytes_per_token
    return max(flops / rates.matmul_flops, nbytes / rates.copy_bandwidth) * 1e3


def summarize(rows: list[dict], after_idle_ms: float | None = None, cost=None, rates=None) -> dict:
    """Per kind of step: counts, host phases, device and idle time; with cost (bench/roofline.py's
    ModelCost) and rates (HardwareRates) also each kind's device time against its steps' bounds."""
    rows = _device_times(rows)
    if after_idle_ms is not None:
        rows = after_idle(rows, after_idle_ms)
    out: dict = {"steps": len(rows), "held_steps": sum(r.get("held", 0) for r in rows)}
    if len(rows) > 1:
        out["wall_ms"] = rows[-1]["t_end"] - rows[0]["t0"]
    if any("gpu_ms" in r for r in rows):
        out["gpu_ms"] = sum(r.get("gpu_ms", 0.0) for r in rows)
        out["idle_ms"] = sum(r.get("idle_ms", 0.0) for r in rows)
    for k in ("decode", "mixed", "prefill", "drain"):
        rs = [r for r in rows if kind(r) == k]
        if not rs:
            continue
        s: dict = {"steps": len(rs), "tokens": sum(r.get("tokens", 0) for r in rs)}
        model_steps = sum(r.get("steps", 1) for r in rs if "seqs" in r)
        if model_steps != len(rs) and k == "decode":  # multi-step batches: a row runs r["steps"] steps
            s["model_steps"] = model_steps
            per = [r["gpu_ms"] / r.get("steps", 1) for r in rs if "gpu_ms" in r]
            if per:
                s["gpu_ms_per_model_step"] = _stats(per)
        # a step's interval: from its start to the next step's start
        for name, a, b in PHASES:
            vals = [r[b] - r[a] for r in rs if a in r and b in r]
            if vals:
                s[name + "_ms"] = _stats(vals)
        for name in ("gpu", "idle"):
            vals = [r[name + "_ms"] for r in rs if name + "_ms" in r]
            if vals:
                s[name + "_ms"] = _stats(vals)
        fit = _fit(rs) if k in ("mixed", "prefill") else None
        if fit is not None:
            s["gpu_fit"] = fit
        if cost is not None:
            pairs = [(r["gpu_ms"], b) for r in rs if "gpu_ms" in r and (b := step_bound_ms(r, cost, rates))]
            if pairs:
                s["bound_ms"] = _stats([b for _, b in pairs])
                s["gpu_over_bound"] = sum(g for g, _ in pairs) / sum(b for _, b in pairs)
        out[k] = s
    if cost is not None:
        pairs = [(r["gpu_ms"], b) for r in rows if "gpu_ms" in r and (b := step_bound_ms(r, cost, rates))]
        if pairs:
            out["bound_ms"] = sum(b for _, b in pairs)
            out["gpu_over_bound"] = sum(g for g, _ in pairs) / out["bound_ms"]
    nxt = {id(r): n for r, n in zip(rows, rows[1:])}
    for k in ("decode", "mixed", "prefill"):
        iv = [nxt[id(r)]["t0"] - r["t0"] for r in rows if kind(r) == k and id(r) in nxt]
        if iv and k in out:
            out[k]["interval_ms"] = _stats(iv)
    return out


def token_gaps(rows: list[dict], decoding_engine: bool = False) -> dict:
    """Each step's interval to the next step, counted once per decode row it carried."""
    rows = sorted((r for r in rows if "seqs" in r and (r["decodes"] > 0 or not decoding_engine)), key=lambda r: r["t0"])
    gaps = sorted(g for a, b in zip(rows, rows[1:]) for g in [b["t0"] - a["t0"]] * a["decodes"])
    if not gaps:
        return {"rows": 0}
    at = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))]  # noqa: E731
    return {"rows": len(gaps), "median_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "p99_over_median": at(0.99) / at(0.5)}


def main(argv: list[str] | None = None) -> int:
    from serve.cli_args import OneLineErrorParser

    p = OneLineErrorParser(prog="python -m bench.trace_summary", description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--json", default=None)
    p.add_argument("--after-idle", type=float, default=None, metavar="MS")
    p.add_argument("--token-gaps", action="store_true")
    p.add_argument("--decoding-engine", action="store_true")
    p.add_argument("--model", default=None,
                   help="the served model (a folder, a config.json or a preset name): each kind of step against its bound")
    p.add_argument("--bench-json", default=None, help="serve bench's result JSON of the run (its rates and GPUs)")
    p.add_argument("--copy-bandwidth", type=float, default=None, metavar="TB/s")
    p.add_argument("--matmul-tflops", type=float, default=None)
    args = p.parse_args(argv)
    try:
        data = Path(args.trace).read_bytes()
        if data[:2] == b"\x1f\x8b":  # gzipped (lab/overlap.sh's KEEP_TRACE)
            data = gzip.decompress(data)
        rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    except OSError as e:
        p.error(f"can't read the trace {args.trace}: {e.strerror or e}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        p.error(f"{args.trace} is not a step trace (one JSON object a line): {e}")
    cost, rates, bench = _bound_inputs(p, args) if args.model else (None, None, None)
    res = token_gaps(rows, args.decoding_engine) if args.token_gaps else summarize(rows, args.after_idle, cost, rates)
    if res.get("bound_ms") and bench and bench.get("roofline_output_throughput") and bench.get("total_output_tokens"):
        res["physical_bound_ms"] = bench["total_output_tokens"] / bench["roofline_output_throughput"] * 1e3
        res["schedule_fraction"] = res["physical_bound_ms"] / res["bound_ms"]
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


def _bound_inputs(p: argparse.ArgumentParser, args: argparse.Namespace):
    """(ModelCost, HardwareRates, serve bench's result or None) for --model, from --bench-json or
    the two rates given."""
    from bench.presets import resolve_model
    from bench.roofline import HardwareRates, ModelCost
    from engine.config import ModelConfig, ModelConfigError

    kv_dtype = "auto"
    res = None
    if args.bench_json:
        try:
            res = json.loads(Path(args.bench_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"can't read serve bench's result {args.bench_json}: {e}")
        if not res.get("copy_bandwidth_tbs") or not res.get("matmul_tflops"):
            p.error(f"{args.bench_json} has no copy_bandwidth_tbs / matmul_tflops (a run without a roofline)")
        bw, tflops = res["copy_bandwidth_tbs"], res["matmul_tflops"]
        kv_dtype = res.get("kv_cache_dtype") or "auto"
    elif args.copy_bandwidth and args.matmul_tflops:
        bw, tflops = args.copy_bandwidth, args.matmul_tflops
    else:
        p.error("--model needs --bench-json, or --copy-bandwidth and --matmul-tflops")
    try:
        cfg = ModelConfig.from_path(resolve_model(args.model))
    except (ValueError, ModelConfigError) as e:
        p.error(str(e))
    return ModelCost.of(cfg, kv_dtype), HardwareRates(bw * 1e12, tflops * 1e12), res


if __name__ == "__main__":
    sys.exit(main())
