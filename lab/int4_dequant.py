"""The 4-bit weight's dequantization (the prompt path past Hopper's W4A16 kernel: dequantize, then
cuBLAS) against its memory bound: `python -m lab.int4_dequant --out F [--model llama3-8b] [--sweep]`.

For each projection of the model: kernels/int4.py's dequantize (the engine's) and, with --sweep,
every plan of it; each time per layer of one CUDA graph over --layers copies of the
weight in turn, so they come from memory. The bound: the words, scales and zero points read plus the
16-bit weight written, at the measured copy bandwidth. Checks each plan's output against the
engine's. Writes one JSON with the GPU and date.
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

GROUP = 128


def run(model: str, layers: int, sweep: bool, path: Path | None) -> dict:
    import torch

    from engine.int4 import quantize
    from kernels import int4
    from lab.kernels import copy_bandwidth, gpu_and_date, graph_us, write_json
    from lab.tp_linear import shapes

    bw = copy_bandwidth()
    out = {**gpu_and_date(), "model": model, "group": GROUP, "layers": layers, "copy_bandwidth": bw, "cases": []}
    plans = list(itertools.product((16, 32, 64), (1, 2, 4, 8), (4, 8))) if sweep else []
    for name, (n, k) in shapes(model, 1).items():
        ws = [quantize((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16(), GROUP) for _ in range(layers)]
        moved = n * k * 2 + sum(t.numel() * t.element_size() for t in ws[0])
        bound_us = moved / bw * 1e6
        ref = int4.dequantize(*ws[0], torch.bfloat16)
        case = {"projection": name, "n": n, "k": k, "bound_us": bound_us,
                "engine_us": graph_us(lambda: [int4.dequantize(*w, torch.bfloat16) for w in ws], per=layers)}
        case["engine_of_bound"] = bound_us / case["engine_us"]
        case["plans"] = []
        for block_n, blocks, warps in plans:
            kw = dict(block_n=block_n, blocks=blocks, warps=warps)
            same = torch.equal(int4.dequantize(*ws[0], torch.bfloat16, **kw), ref)
            us = graph_us(lambda: [int4.dequantize(*w, torch.bfloat16, **kw) for w in ws], per=layers)
            case["plans"].append({**kw, "us": us, "of_bound": bound_us / us, "equal": same})
        if case["plans"]:
            case["best"] = min(case["plans"], key=lambda p: p["us"])
        print(name, f"bound {bound_us:.1f} us, engine {case['engine_us']:.1f} us", case.get("best", ""), flush=True)
        out["cases"].append(case)
        write_json(path, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.int4_dequant", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sweep", action="store_true")
    a = p.parse_args(argv)
    run(a.model, a.layers, a.sweep, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
