"""4-bit projections against the 16-bit ones and their own roofline: `python -m lab.int4_gemm --out F
[--rows 1,64,512] [--model llama3-8b] [--sweep]`.

For each projection of the model (lab/tp_linear.py's shapes) and row count: the engine's 16-bit path
(kernels/linear.py), the W4A16 GEMMs with their default plans (w4a16_matmul: Hopper's Gluon kernel,
kernels/int4_wgmma.py, where it applies; and kernels/int4.py's Triton kernel), the weight
dequantized then cuBLAS (dequantize + F.linear), and int4_linear (what the engine runs). Each time is
per layer of one CUDA graph over --layers copies of the weight in turn, so the weights come from
memory. The bound: max(FLOPs / the measured bf16 matmul rate, bytes / copy bandwidth), a 4-bit weight
at half a byte plus its groups' float16 scale and uint8 zero point. --sweep: every plan of both
W4A16 kernels for few rows, the fastest kept. Writes one JSON with the GPU and date.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

GROUP = 128


def _weights(n: int, k: int, layers: int):
    import torch

    from engine.int4 import quantize

    w16 = [(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for _ in range(layers)]
    return w16, [quantize(w, GROUP) for w in w16]


def run(model: str, rows: list[int], layers: int, path: Path | None) -> dict:
    import torch

    from bench.hardware import measure
    from kernels import int4, int4_wgmma, linear, reference
    from lab.kernels import gpu_and_date, graph_us
    from lab.tp_linear import shapes

    hw = measure()
    bandwidth, rate = hw.copy_bandwidth, hw.matmul_flops
    out = gpu_and_date() | {"model": model, "copy_bandwidth": bandwidth, "matmul_rate_bf16": rate, "group": GROUP,
                            "layers": layers, "timing": "cuda graph", "gemms": []}
    print(f"{out['gpu']}: {bandwidth / 1e12:.2f} TB/s, {rate / 1e12:.0f} TFLOP/s bf16", flush=True)
    for name, (n, k) in shapes(model, 1).items():
        w16, q4 = _weights(n, k, layers)
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            row = {"proj": name, "M": m, "N": n, "K": k}

            def timer(f, ws):
                return graph_us(lambda: [f(w) for w in ws], rep=100, per=layers)

            row["bf16_us"] = timer(lambda w: linear.linear(x, w), w16)
            row["w4a16_us"] = timer(lambda q: int4.w4a16_matmul(x, *q), q4)
            row["w4a16_triton_us"] = timer(lambda q: int4.w4a16_matmul(x, *q, hopper=False), q4)
            if int4_wgmma.supports(x[:1], k, GROUP):  # Hopper's kernel past its row limit too
                row["hopper_us"] = timer(lambda q: int4_wgmma.w4a16_matmul(x, *q, GROUP), q4)
            row["dequant_cublas_us"] = timer(lambda q: reference.linear(x, int4.dequantize(*q, torch.bfloat16)), q4)
            row["int4_linear_us"] = timer(lambda q: int4.int4_linear(x, *q), q4)
            want = reference.int4_linear(x, *q4[0]).float()
            row["max_rel_err"] = ((int4.int4_linear(x, *q4[0]).float() - want).abs().max() / want.abs().max()).item()
            flops, params = 2 * m * n * k, n * k
            act = 2 * m * k + 2 * m * n
            row["int4_bound_us"] = max(flops / rate, (params * (0.5 + 3 / GROUP) + act) / bandwidth) * 1e6
            row["bf16_bound_us"] = max(flops / rate, (2 * params + act) / bandwidth) * 1e6
            row["int4_of_bound"] = row["int4_bound_us"] / row["int4_linear_us"]
            row["int4_over_bf16"] = row["int4_linear_us"] / row["bf16_us"]
            out["gemms"].append(row)
            if path is not None:
                path.write_text(json.dumps(out, indent=1))
            print(json.dumps({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()}), flush=True)
        del w16, q4
        torch.cuda.empty_cache()
    return out


def sweep(model: str, rows: list[int], layers: int, path: Path | None) -> dict:
    """w4a16_matmul's plans for few rows: every (block_n, split, stages), the fastest kept."""
    import torch

    from kernels import int4, int4_wgmma
    from kernels.launch import sm_count
    from lab.kernels import gpu_and_date, graph_us
    from lab.tp_linear import shapes

    out = gpu_and_date() | {"model": model, "layers": layers, "timing": "cuda graph", "plans": []}
    for name, (n, k) in shapes(model, 1).items():
        _, q4 = _weights(n, k, layers)
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            default = int4.plan(m, n, k, sm_count(x.device))
            results = []
            for block_n, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 3, 4)):
                p = int4.Plan(default.block_m, block_n, split, stages=stages)
                try:
                    us = graph_us(lambda: [int4.w4a16_matmul(x, *q, out=o, p=p) for q in q4], rep=50, per=layers)
                except Exception as e:  # a plan that does not compile (shared memory) is skipped
                    print(f"{name} M={m} {p}: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                results.append((us, p))
            results.sort(key=lambda r: r[0])
            best_us, best = results[0]
            default_us = graph_us(lambda: [int4.w4a16_matmul(x, *q, out=o, p=default) for q in q4], rep=50, per=layers)
            row = {"proj": name, "M": m, "N": n, "K": k, "best_us": best_us, "best": best.__dict__,
                   "default_us": default_us, "default": default.__dict__,
                   "top5": [(round(us, 2), p.__dict__) for us, p in results[:5]]}
            if int4_wgmma.supports(x, k, GROUP):
                hp = int4_wgmma.plan(m, n, k, sm_count(x.device))
                timed = [(graph_us(lambda: [int4_wgmma.w4a16_matmul(x, *q, GROUP, out=o, p=p) for q in q4],
                                   rep=50, per=layers), p)
                         for p in (int4_wgmma.Plan(hp.block_m, split) for split in (1, 2, 4, 8, 16, 32))
                         if k // int4_wgmma.BLOCK_K >= split]
                timed.sort(key=lambda r: r[0])
                row |= {"hopper_default": hp.__dict__, "hopper_best": timed[0][1].__dict__,
                        "hopper_us": {p.split: round(us, 2) for us, p in timed}}
            out["plans"].append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "top5"}), flush=True)
            if path is not None:
                path.write_text(json.dumps(out, indent=1))
        q4.clear()
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--rows", default="1,16,64,128,256,512,2048")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path)
    p.add_argument("--sweep", action="store_true", help="the few-row plans instead")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    (sweep if args.sweep else run)(args.model, rows, args.layers, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
