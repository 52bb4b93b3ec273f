"""Can the 4-bit dequantization of a prompt step hide beside its compute-bound matmuls? A probe on
the GPU: Llama-3-8B's four projections, bf16 x of M rows. In CUDA graphs (no host gaps), each timed
alone and overlapped: the engine's dequantize() of one weight on a side stream while cuBLAS multiplies
another on the main stream, and a whole layer's four matmuls beside the next layer's four
dequantizations (what a prefetch one layer ahead would run). Weights are random words: the kernels'
work does not depend on the values.

    python -m lab.int4_overlap_probe [--rows 384,896,2048] [--priority -1] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

# (name, N, K) of Llama-3-8B's projections
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
GROUP = 128


def weight(N: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), dtype=torch.int32, device="cuda")
    s = (torch.rand(K // GROUP, N, device="cuda") / 64).half()
    z = torch.randint(0, 16, (K // GROUP, N), dtype=torch.uint8, device="cuda")
    return w, s, z


def graph_ms(fn, replays: int = 20, reps: int = 5) -> float:
    """ms of one fn() captured in a CUDA graph: the median of reps timings of `replays` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="384,896,2048")
    p.add_argument("--json", default=None)
    p.add_argument("--priority", type=int, default=0, help="the side stream's priority (-1: high)")
    a = p.parse_args(argv)
    from kernels import int4

    q = {name: weight(N, K) for name, N, K in SHAPES}
    dense = {name: int4.dequantize(*q[name], torch.bfloat16) for name, _, _ in SHAPES}
    side = torch.cuda.Stream(priority=a.priority)

    def deq(name: str):  # into a new buffer each time, as the engine's prompt steps do
        return lambda: int4.dequantize(*q[name], torch.bfloat16)

    def both(main_fn, side_fns):
        def fn():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for f in side_fns:
                    f()
            main_fn()
            torch.cuda.current_stream().wait_stream(side)
        return fn

    out: dict = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                 "what": __doc__.split("\n\n")[0], "side_priority": a.priority, "dequant_ms": {}, "rows": {}}
    for name, _, _ in SHAPES:
        out["dequant_ms"][name] = graph_ms(deq(name))
    for M in (int(r) for r in a.rows.split(",")):
        xs = {K: torch.randn(M, K, device="cuda").bfloat16() for K in {K for _, _, K in SHAPES}}
        ys = {name: torch.empty(M, N, dtype=torch.bfloat16, device="cuda") for name, N, _ in SHAPES}

        def mm(name: str, K: int):
            return lambda: torch.mm(xs[K], dense[name].t(), out=ys[name])

        row: dict = {"matmul_ms": {}, "pairs": {}}
        for name, _, K in SHAPES:
            row["matmul_ms"][name] = graph_ms(mm(name, K))
        # each matmul beside the next projection's dequantization (the order of a layer)
        for i, (name, _, K) in enumerate(SHAPES):
            nxt = SHAPES[(i + 1) % len(SHAPES)][0]
            alone = row["matmul_ms"][name] + out["dequant_ms"][nxt]
            together = graph_ms(both(mm(name, K), [deq(nxt)]))
            row["pairs"][f"{name} + dequant {nxt}"] = {"serial_ms": alone, "overlapped_ms": together}
        layer_mm = [mm(name, K) for name, _, K in SHAPES]
        serial = graph_ms(lambda: [f() for f in layer_mm] + [deq(n)() for n, _, _ in SHAPES])
        over = graph_ms(both(lambda: [f() for f in layer_mm], [deq(n) for n, _, _ in SHAPES]))
        row["layer"] = {"matmuls_ms": sum(row["matmul_ms"].values()),
                        "dequant_ms": sum(out["dequant_ms"].values()), "serial_ms": serial, "overlapped_ms": over}
        out["rows"][M] = row
        print(f"M={M}: matmuls {row['layer']['matmuls_ms']:.3f} ms + dequant {row['layer']['dequant_ms']:.3f}: "
              f"serial {serial:.3f}, overlapped {over:.3f}")
        for k, v in row["pairs"].items():
            print(f"   {k}: serial {v['serial_ms']:.3f}, overlapped {v['overlapped_ms']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
