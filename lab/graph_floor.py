"""What a kernel costs inside a CUDA graph when it does almost nothing: the floor under a small
model's decode step, which is ~190 dependent kernels (Qwen2.5-0.5B: 8 a layer).

    python -m lab.graph_floor [--nodes 192] [--json OUT]

Each case captures `nodes` launches, each depending on the one before (one stream), and times the
graph's replay with CUDA events (median of 20 after 5 warm-ups): an empty kernel of 64 programs, a
64 x 896 bf16 copy, the engine's add + RMSNorm at 64 x 896 (Qwen2.5-0.5B's hidden size), and its
skinny qkv matmul (896 -> 1,152, bias), with one weight (from L2) and with a weight per node (from
memory). The per-node time less the empty kernel's is what a kernel's own work adds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.fused import rms_norm
from kernels.linear import skinny_linear
from lab.kernels import write_json


@triton.jit
def _empty(x_ptr):
    pass


@triton.jit
def _copy(x_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    tl.store(y_ptr + row * N + cols, tl.load(x_ptr + row * N + cols, mask=cols < N), mask=cols < N)


def replay_us(fn: Callable[[int], None], nodes: int) -> float:
    """Median microseconds of one replay of a graph of `nodes` calls fn(i), per node."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(nodes):  # compile and warm outside the capture
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i in range(nodes):
            fn(i)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / nodes)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.graph_floor", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=192)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lab.graph_floor: needs a CUDA GPU", file=sys.stderr)
        return 1
    dev, bf = "cuda", torch.bfloat16
    M, H, N = 64, 896, 1152
    x = torch.randn(M, H, device=dev, dtype=bf)
    r = torch.randn(M, H, device=dev, dtype=bf)
    y = torch.empty_like(x)
    g = torch.ones(H, device=dev, dtype=bf)
    w1 = torch.randn(N, H, device=dev, dtype=bf) * 0.02
    bias = torch.zeros(N, device=dev, dtype=bf)
    copies = 48  # ~99 MB of weights: twice the L2
    ws = [torch.randn(N, H, device=dev, dtype=bf) * 0.02 for _ in range(copies)]
    out = torch.empty(M, N, device=dev, dtype=bf)
    cases: dict[str, Callable[[int], None]] = {
        "empty kernel, 64 programs": lambda i: _empty[(64,)](x),
        "copy 64 x 896 bf16": lambda i: _copy[(M,)](x, y, H, 1024),
        "add + RMSNorm 64 x 896": lambda i: rms_norm(x, g, 1e-6, r),
        "skinny qkv 64 x 896 -> 1152, one weight (L2)": lambda i: skinny_linear(x, w1, bias, out),
        "skinny qkv, a weight per node (memory)": lambda i: skinny_linear(x, ws[i % copies], bias, out),
    }
    res = {"gpu": torch.cuda.get_device_name(), "nodes": a.nodes, "us_per_node": {}}
    for name, fn in cases.items():
        us = replay_us(fn, a.nodes)
        res["us_per_node"][name] = round(us, 3)
        print(f"{name:48s} {us:7.2f} us a node")
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
