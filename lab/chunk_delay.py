"""Where a stream's chunk gaps grow: the engine, the API process or the client.

    python -m lab.chunk_delay BENCH_JSON ENGINE_TRACE API_TRACE [--out F]

BENCH_JSON: `serve bench --chunk-times --result-json`; ENGINE_TRACE: the server's
PAGEDSERVE_STEP_TRACE (jsonl, or .gz); API_TRACE: its PAGEDSERVE_API_TRACE. All three read
time.perf_counter, the system's monotonic clock on Linux. Each client chunk is matched to the last
API row that handed outputs to the streams before it arrived, and that row to the last engine step
sent before the API took it in. Reports the gaps as the client, the API and the engine saw them
(p50/p90/p99/max), the delay of each hop, and for the client's largest gaps (its p99 and above)
how much of each gap the engine's own step gap explains; and a request's way to its first token,
hop by hop.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from pathlib import Path


def _rows(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"n": len(xs), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": xs[-1]}


def analyse(bench: dict, engine: list[dict], api: list[dict]) -> dict:
    start_ms = bench["clock_start_s"] * 1e3
    sent = sorted(r["t_sent"] for r in engine if "t_sent" in r)
    taken = sorted((r["t0"], r["t_end"]) for r in api if r.get("outputs"))
    reqs = [r for r in api if "request" in r and r.get("first") is not None and r["t0"] >= start_ms]
    taken_end = [e for _, e in taken]
    hop_engine_api = []
    for t0, _ in taken:
        i = bisect.bisect_right(sent, t0) - 1
        if i >= 0:
            hop_engine_api.append(t0 - sent[i])
    client_gaps, hop_api_client, big = [], [], []
    for req in bench["requests"]:
        times = [start_ms + (req["start_s"] + t) * 1e3 for t in req.get("chunk_s") or []]
        for a, b in zip(times, times[1:]):
            client_gaps.append((b - a, a, b))
        for t in times:
            j = bisect.bisect_right(taken_end, t) - 1
            if j >= 0:
                hop_api_client.append(t - taken_end[j])
    # the engine process's side: when it took each request in (its row lists the sequences)
    took = {sid: r["t0"] for r in engine if "added" in r for sid in r["added"]}
    api_arrival = {r["request"]: r["t0"] for r in reqs}
    api_ack = {r["request"]: r["added"] for r in reqs if r.get("added") is not None}
    api_to_engine = [took[s] - api_arrival[s] for s in api_arrival if s in took]
    engine_to_ack = [api_ack[s] - took[s] for s in api_ack if s in took]
    # gaps within the measured run (the traces also hold the warm-up and the idle time before it)
    api_gaps = [b[0] - a[0] for a, b in zip(taken, taken[1:]) if a[0] >= start_ms]
    engine_gaps = [b - a for a, b in zip(sent, sent[1:]) if a >= start_ms]
    client_gaps.sort()
    cut = client_gaps[int(0.99 * len(client_gaps))][0] if client_gaps else 0.0
    for gap, a, b in client_gaps:
        if gap < cut:
            continue
        # the engine steps whose outputs these two chunks carried: the last sent before each arrival
        ia, ib = bisect.bisect_right(sent, a) - 1, bisect.bisect_right(sent, b) - 1
        ja, jb = bisect.bisect_right(taken_end, a) - 1, bisect.bisect_right(taken_end, b) - 1
        big.append({"gap_ms": gap, "engine_gap_ms": sent[ib] - sent[ia] if ia >= 0 else None,
                    "api_gap_ms": taken_end[jb] - taken_end[ja] if ja >= 0 else None,
                    "late_at_api_ms": b - taken_end[jb] if jb >= 0 else None,
                    "at_s": (a - start_ms) / 1e3})
    # a request's way to its first token: client send -> the API's intake -> its add (after HTTP and validation;
    # the i-th send matched to the i-th arrival, an approximation) -> the engine's ack -> first token
    sends = sorted(start_ms + r["start_s"] * 1e3 for r in bench["requests"])
    arrivals_api = sorted(r["t0"] for r in reqs)
    received = sorted(r["received"] for r in reqs if r.get("received") is not None)
    ttft = {"client_ms": _pct([r["ttft_ms"] for r in bench["requests"] if r.get("ttft_ms") is not None]),
            "client_to_api_add_ms": _pct([a - c for c, a in zip(sends, arrivals_api)]),
            # the API's add split where the HTTP request came in: before it the server's intake, after it
            # reading the body, validating and planning it (text prompts: the tokenizing process's round trip)
            "client_to_api_received_ms": _pct([a - c for c, a in zip(sends, received)]),
            "api_received_to_add_ms": _pct([r["t0"] - r["received"] for r in reqs if r.get("received") is not None]),
            "api_add_to_engine_ack_ms": _pct([r["added"] - r["t0"] for r in reqs if r.get("added") is not None]),
            "api_add_to_engine_took_ms": _pct(api_to_engine), "engine_took_to_api_ack_ms": _pct(engine_to_ack),
            "engine_ack_to_first_token_ms": _pct([r["first"] - r["added"] for r in reqs if r.get("added") is not None]),
            "api_add_to_first_token_ms": _pct([r["first"] - r["t0"] for r in reqs])}
    return {"client_gap_ms": _pct([g for g, _, _ in client_gaps]), "api_gap_ms": _pct(api_gaps),
            "engine_gap_ms": _pct(engine_gaps), "engine_to_api_ms": _pct(hop_engine_api),
            "api_to_client_ms": _pct(hop_api_client), "ttft": ttft, "largest_client_gaps": big[-40:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.chunk_delay", description=__doc__.splitlines()[0])
    p.add_argument("bench_json")
    p.add_argument("engine_trace")
    p.add_argument("api_trace")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    bench = json.loads(Path(a.bench_json).read_text())
    if "clock_start_s" not in bench:
        p.error(f"{a.bench_json} has no chunk times: run serve bench with --chunk-times")
    res = analyse(bench, _rows(a.engine_trace), _rows(a.api_trace))
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
