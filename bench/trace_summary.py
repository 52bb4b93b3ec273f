"""Summarize a PAGEDSERVE_STEP_TRACE file (scheduler/trace.py): per kind of step, how the engine
loop's wall time splits into scheduling, launching, waiting for the previous step's tokens,
processing them and sending the outputs.

    python -m bench.trace_summary trace.jsonl [--json out.json]
"""
from __future__ import annotations

import argparse
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


def summarize(rows: list[dict]) -> dict:
    out: dict = {"steps": len(rows), "held_steps": sum(r.get("held", 0) for r in rows)}
    if len(rows) > 1:
        out["wall_ms"] = rows[-1]["t_end"] - rows[0]["t0"]
    for k in ("decode", "mixed", "prefill", "drain"):
        rs = [r for r in rows if kind(r) == k]
        if not rs:
            continue
        s: dict = {"steps": len(rs), "tokens": sum(r.get("tokens", 0) for r in rs)}
        # a step's interval: from its start to the next step's start
        for name, a, b in PHASES:
            vals = [r[b] - r[a] for r in rs if a in r and b in r]
            if vals:
                s[name + "_ms"] = {"mean": statistics.fmean(vals), "median": statistics.median(vals),
                                   "sum": sum(vals)}
        out[k] = s
    nxt = {id(r): n for r, n in zip(rows, rows[1:])}
    for k in ("decode", "mixed", "prefill"):
        iv = [nxt[id(r)]["t0"] - r["t0"] for r in rows if kind(r) == k and id(r) in nxt]
        if iv and k in out:
            out[k]["interval_ms"] = {"mean": statistics.fmean(iv), "median": statistics.median(iv), "sum": sum(iv)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line.strip()]
    res = summarize(rows)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
