"""Put result JSONs side by side with their ratio to a baseline:

python -m lab.compare --key median_ttft_ms --lower-is-better --baseline off.json on.json --out prefix.json

Writes {key, baseline, runs: [{file, value, speedup}], gpu, date}: speedup = run / baseline, or
baseline / run with --lower-is-better (so > 1 always means the run is better).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


# kept from every result, however large the rest of it
SUMMARY_KEYS = ("model", "kv_cache_dtype", "pdl", "server_args", "num_prompts", "concurrency", "input_len", "output_len",
                "completed", "failed", "output_throughput", "roofline_output_throughput", "roofline_fraction",
                "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "median_itl_ms", "decode_step_ms",
                "roofline_decode_step_ms", "repeat_throughputs")


def summary(res: dict) -> dict:
    return {k: res[k] for k in SUMMARY_KEYS if k in res}


def compare(key: str, baseline: dict, runs: dict[str, dict], lower_is_better: bool) -> dict:
    base = baseline[key]
    rows = []
    for name, res in runs.items():
        value = res[key]
        speedup = base / value if lower_is_better else value / base
        rows.append({"file": name, "value": value, "speedup": speedup, "summary": summary(res)})
    return {"key": key, "lower_is_better": lower_is_better, "baseline_value": base,
            "baseline_summary": summary(baseline), "runs": rows,
            "gpu": baseline.get("gpu"), "date": baseline.get("date")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--key", required=True)
    p.add_argument("--baseline", required=True)
    p.add_argument("--lower-is-better", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("runs", nargs="+")
    args = p.parse_args(argv)
    baseline = json.loads(Path(args.baseline).read_text())
    runs = {Path(r).name: json.loads(Path(r).read_text()) for r in args.runs}
    res = compare(args.key, baseline, runs, args.lower_is_better)
    res["baseline"] = {"file": Path(args.baseline).name, **baseline} if len(json.dumps(baseline)) < 20000 \
        else {"file": Path(args.baseline).name}
    res["run_results"] = {k: v for k, v in runs.items() if len(json.dumps(v)) < 20000}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for r in res["runs"]:
        print(f"{r['file']}: {args.key} {r['value']:.4g} vs {res['baseline_value']:.4g}: {r['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
