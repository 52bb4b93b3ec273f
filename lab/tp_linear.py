"""The decode step's projections at tensor-parallel shapes: `python -m lab.tp_linear --out F`.

Llama-3-8B (or --model llama3-70b) at TP = 1 and 2, 64 rows, bf16: each projection (qkv, o,
gate/up with SiLU, down; --proj some of them) timed as a decode step sees it, in one CUDA graph over
several layers' weights in turn (beyond L2), by each path the engine could take: cuBLAS
(kernels/reference.py), the engine's own choice (kernels/linear.py's linear() with PDL), the skinny
kernel with and without PDL at its plan() and at other tiles, and for gate/up the fused kernel
(kernels/gate_up.py) at several tiles against cuBLAS + the SiLU kernel. Each time is per layer, with
the fraction of the copy bandwidth measured in the same run over the weight bytes; every
candidate's output is checked against cuBLAS. Writes one JSON with the GPU's name and the date.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

from lab.kernels import copy_bandwidth, graph_us

# hidden, intermediate, heads, KV heads, head dim
MODELS = {"llama3-8b": (4096, 14336, 32, 8, 128), "llama3-70b": (8192, 28672, 64, 8, 128),
          "qwen2.5-0.5b": (896, 4864, 14, 2, 64)}
ROWS = 64
# skinny kernel tiles: (block_n, block_k, split, num_warps, num_stages)
SKINNY = [(32, 128, 2, 4, 4), (32, 128, 4, 4, 4), (32, 128, 8, 4, 4), (64, 128, 2, 4, 4), (64, 128, 4, 4, 4),
          (16, 128, 4, 4, 4), (16, 128, 8, 4, 4), (32, 64, 4, 4, 6), (64, 64, 4, 4, 6), (32, 128, 4, 4, 6)]
# fused gate/up tiles: (block_m, block_n, block_k, num_warps, num_stages)
GATE_UP = [(64, 32, 128, 4, 3), (64, 16, 128, 4, 4), (64, 32, 128, 4, 4), (64, 16, 128, 4, 6), (64, 64, 128, 4, 3),
           (64, 16, 256, 4, 3), (64, 32, 64, 4, 6), (64, 64, 64, 4, 4), (64, 16, 64, 4, 8)]


def shapes(model: str, tp: int) -> dict[str, tuple[int, int]]:
    """Projection -> (N, K) of one rank's weight."""
    hidden, inter, heads, kv_heads, head_dim = MODELS[model]
    qkv = (heads + 2 * kv_heads) * head_dim // tp
    return {"qkv": (qkv, hidden), "o": (hidden, heads * head_dim // tp), "gate_up": (2 * inter // tp, hidden),
            "down": (hidden, inter // tp)}


def run(layers: int, tps: list[int], model: str = "llama3-8b", projections: list[str] | None = None) -> dict:
    import torch

    from kernels import fused, gate_up as gu, linear, reference

    bw = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(), "copy_bandwidth": bw,
           "model": model, "rows": ROWS, "layers": layers, "cases": []}
    print(f"{out['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for tp in tps:
        for name, (n, k) in shapes(model, tp).items():
            if projections and name not in projections:
                continue
            g = torch.Generator(device="cuda").manual_seed(n + k)
            ws = [(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16() for _ in range(layers)]
            xs = [torch.randn(ROWS, k, device="cuda", generator=g).bfloat16() for _ in range(layers)]
            nbytes = n * k * 2
            rows = []

            def add(path: str, fn, want=None) -> None:
                try:
                    got = fn(xs[0], ws[0])
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item() if want is not None else 0.0
                    us = graph_us(lambda: [fn(x, w) for x, w in zip(xs, ws)], per=layers)
                    rows.append({"path": path, "us": us, "fraction_of_copy_bw": nbytes / (us * 1e-6) / bw,
                                 "rel_err": err})
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile is a result
                    rows.append({"path": path, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})

            if name == "gate_up":
                inter = n // 2
                want = fused.silu_and_mul(reference.linear(xs[0], ws[0]))
                add("cublas+silu", lambda x, w: fused.silu_and_mul(reference.linear(x, w)), want)
                add("cublas+silu pdl", lambda x, w: fused.silu_and_mul(reference.linear(x, w), pdl=True), want)
                pick = gu.plan(ROWS, inter, k)
                add(f"fused plan() {pick}", lambda x, w: gu.gate_up_silu(x, w, pick), want)
                for t in GATE_UP:
                    p = gu.Plan(*t)
                    add(f"fused {t}", lambda x, w, p=p: gu.gate_up_silu(x, w, p), want)
            else:
                want = reference.linear(xs[0], ws[0])
                add("cublas", reference.linear, want)
                add("engine linear() pdl", lambda x, w: linear.linear(x, w, pdl=True), want)
                pick = linear.plan(ROWS, n, k)
                for pdl in (False, True):
                    add(f"skinny plan() {pick} pdl={pdl}",
                        lambda x, w, pdl=pdl: linear.skinny_linear(x, w, p=pick, pdl=pdl), want)
                for t in SKINNY:
                    p = linear.Plan(t[0], t[1], t[2], swap=False, num_warps=t[3], num_stages=t[4])
                    if k % p.block_k:
                        continue
                    for pdl in (False, True):
                        add(f"skinny {t} pdl={pdl}", lambda x, w, p=p, pdl=pdl: linear.skinny_linear(x, w, p=p, pdl=pdl),
                            want)
            ok = [r for r in rows if "us" in r and r["rel_err"] < 2e-2]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            out["cases"].append({"tp": tp, "proj": name, "n": n, "k": k, "weight_bytes": nbytes, "rows": rows,
                                 "best": best})
            for r in rows:
                print(f"TP={tp} {name:8s} {r['path']:48s} " + (f"{r['us']:7.2f} us {r['fraction_of_copy_bw']:5.1%}"
                      f" err {r['rel_err']:.1e}" if "us" in r else r["error"]), flush=True)
            if best:
                print(f"TP={tp} {name}: best {best['path']} {best['us']:.2f} us", flush=True)
            del ws, xs
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8, help="weights cycled in the graph (beyond L2)")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes whose shapes to time")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--proj", default=None, help="comma-separated projections to time (default: all)")
    args = ap.parse_args(argv)
    res = run(args.layers, [int(t) for t in args.tp.split(",")], args.model,
              args.proj.split(",") if args.proj else None)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
