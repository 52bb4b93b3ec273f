"""How much memory-bound work fits beside compute-bound work at the power limit? One GPU:
`python -m lab.power_overlap --out F`.

The physical bound of `serve bench` lets a step use the tensor cores at the matmul rate and the
memory at the copy bandwidth at once. A GPU held at its power limit (an H100: 700 W, reached within
a second of matmuls, bench/NOTES.md 2026-11-27) may not have the power for both. Here, for
--seconds each, on two streams of one GPU: a compute-bound matmul (a mixed step's prompt rows:
--rows x 14,336 x 4,096) alone, a memory-bound one (64 rows over --weights-gib of weights, a
decode step's projections) alone, then both back to back on their own streams at once. Each side's
rate is its work over the window (CUDA events), and the sum of the two fractions of their alone
rates says what overlap buys: 1.0 is none, 2.0 is the physical bound's assumption. Writes one JSON
with the GPU and the date.
"""
from __future__ import annotations

import argparse
import itertools
import json
import threading
import time

import torch

from lab.kernels import write_json

HIDDEN, INTER = 4096, 14336  # Llama-3-8B's gate/up projection


def _loop(fn, stream: torch.cuda.Stream, seconds: float, per: int) -> tuple[int, float]:
    """Run fn in batches of `per` on `stream` for `seconds` of host time; (calls, device ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    with torch.cuda.stream(stream):
        start.record()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            for _ in range(per):
                fn()
            calls += per
            if calls % (per * 8) == 0:  # a bounded queue
                stream.synchronize()
        end.record()
    end.synchronize()
    return calls, start.elapsed_time(end)


def measure(rows: int, weights_gib: float, seconds: float, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)

    x_big, w_big = randn(rows, HIDDEN), randn(INTER, HIDDEN) / HIDDEN ** 0.5
    out_big = torch.empty(rows, INTER, device=device, dtype=torch.bfloat16)
    copies = max(1, int(weights_gib * 2**30 / (INTER * HIDDEN * 2)))
    x_small, ws = randn(64, HIDDEN), [randn(INTER, HIDDEN) / HIDDEN ** 0.5 for _ in range(copies)]
    out_small = torch.empty(64, INTER, device=device, dtype=torch.bfloat16)
    weights = itertools.cycle(ws)  # each product reads the next copy: from memory, not L2

    def compute():
        torch.matmul(x_big, w_big.t(), out=out_big)

    def memory():
        torch.matmul(x_small, next(weights).t(), out=out_small)

    flops, nbytes = 2 * rows * INTER * HIDDEN, INTER * HIDDEN * 2
    a, b = torch.cuda.Stream(device), torch.cuda.Stream(device)
    for fn in (compute, memory):  # warm-up, and the GPU to its power limit
        _loop(fn, a, 1.0, 8)
    res = {}
    n, ms = _loop(compute, a, seconds, 8)
    res["compute_alone_tflops"] = flops * n / ms / 1e9
    n, ms = _loop(memory, b, seconds, 32)
    res["memory_alone_tbs"] = nbytes * n / ms / 1e9
    # both at once: each loop on its own stream, launched from two threads so neither waits on the other
    out: dict[str, tuple[int, float]] = {}
    threads = [threading.Thread(target=lambda k=k, fn=fn, s=s, per=per: out.__setitem__(k, _loop(fn, s, seconds, per)))
               for k, fn, s, per in (("compute", compute, a, 8), ("memory", memory, b, 32))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res["compute_beside_tflops"] = flops * out["compute"][0] / out["compute"][1] / 1e9
    res["memory_beside_tbs"] = nbytes * out["memory"][0] / out["memory"][1] / 1e9
    res["sum_of_fractions"] = (res["compute_beside_tflops"] / res["compute_alone_tflops"]
                               + res["memory_beside_tbs"] / res["memory_alone_tbs"])
    return {"rows": rows, "weights_gib": round(copies * nbytes / 2**30, 2), "seconds": seconds,
            **{k: round(v, 4) for k, v in res.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.power_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="2048,512", help="rows of the compute-bound matmul, comma-separated")
    p.add_argument("--weights-gib", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(device), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": []}
    for rows in (int(r) for r in a.rows.split(",")):
        r = measure(rows, a.weights_gib, a.seconds, device)
        result["runs"].append(r)
        print(json.dumps(r), flush=True)
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
