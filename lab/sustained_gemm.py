"""Does a matmul keep its rate under sustained load? `python -m lab.sustained_gemm --out F`.

The bounds in `serve bench` charge compute at the matmul rate `bench/hardware.py` measures in a
short burst. A served run of a compute-heavy model keeps the tensor cores busy for minutes, and a
GPU held at its power limit lowers its clocks. This runs one matmul shape back to back for
--seconds (weights rotated over --copies so they come from memory, as in a step), and reports the
rate of each window of --window-ms (CUDA events around the window's products). Run nvidia-smi's
logging beside it to see the clocks and power. Writes one JSON with the GPU and the date.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from lab.kernels import write_json


def parse_shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(x) for x in text.lower().split("x"))
    return m, n, k


def run(shape: tuple[int, int, int], seconds: float, window_ms: float, copies: int, device) -> dict:
    m, n, k = shape
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    flops = 2 * m * n * k
    for w in ws * 3:  # warm-up: cuBLAS's handle and heuristics
        torch.matmul(x, w.t(), out=out)
    torch.cuda.synchronize(device)
    # products per window from a first timing
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(20):
        torch.matmul(x, ws[i % copies].t(), out=out)
    end.record()
    end.synchronize()
    per = max(1, int(window_ms / (start.elapsed_time(end) / 20)))
    windows = []
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per):
            torch.matmul(x, ws[i % copies].t(), out=out)
            i += 1
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        windows.append({"t_s": round(time.monotonic() - t0, 3), "tflops": round(flops * per / ms / 1e9, 1)})
    rates = [w["tflops"] for w in windows]
    head = rates[:max(1, len(rates) // 20)]
    tail = rates[-max(1, len(rates) // 4):]
    return {"shape_mnk": [m, n, k], "products_per_window": per, "windows": windows,
            "first_5pct_tflops": round(sum(head) / len(head), 1), "last_25pct_tflops": round(sum(tail) / len(tail), 1),
            "last_over_first": round(sum(tail) / len(tail) / (sum(head) / len(head)), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.sustained_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", default=None, metavar="MxNxK",
                   help="default: the 70B's TP=2 gate/up at 768 rows and 8192^3")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--window-ms", type=float, default=250.0)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    shapes = [parse_shape(s) for s in (a.shape or ["768x28672x8192", "8192x8192x8192"])]
    result = {"gpu": torch.cuda.get_device_name(device), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "seconds": a.seconds, "runs": []}
    for shape in shapes:
        r = run(shape, a.seconds, a.window_ms, a.copies, device)
        result["runs"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "windows"}), flush=True)
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
