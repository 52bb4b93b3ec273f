"""The fused gate/up + SiLU GEMM against cuBLAS + the SiLU kernel: `python -m lab.gate_up [--out DIR]`.

For Qwen2.5-0.5B's and Llama-3-8B's MLP at prefill and mixed-step token counts (and a decode
batch), times in one run: cuBLAS's gate_up GEMM alone, cuBLAS + kernels/fused.py silu_and_mul
(the unfused path), and kernels/gate_up.py at the sweep's plans (triton.testing.do_bench, medians,
warmed up; L2 not flushed, so decode-sized rows here are not what a decode step sees: time
those in a CUDA graph over many layers' weights). Reports each plan's time, TFLOP/s and speed-up
over the unfused path, which plan kernels/gate_up.plan() picks (none: the engine keeps the unfused
path), and checks every plan's result against the unfused path's. Decode batches are also timed
as a decode step sees them: one CUDA graph over several layers' weights in turn (cold L2), the
unfused path (its SiLU kernel with PDL, as in the engine) against plan()'s. Writes gate-up-<gpu>.json.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from lab.kernels import RESULTS, gpu_and_date, graph_us, slug, write_json

MODELS = {"qwen2.5-0.5b": (896, 4864), "llama3-8b": (4096, 14336)}  # hidden (K), intermediate (I)
SHAPES = [("qwen2.5-0.5b", m) for m in (64, 512, 1024, 2048, 3328, 8192)] + \
         [("llama3-8b", m) for m in (64, 512, 2048, 8192)]
# (block_m, block_n, block_k, num_warps, num_stages, group_m)
PLANS = [(128, 64, 64, 8, 3, 8), (128, 64, 64, 8, 3, 16), (128, 64, 64, 8, 4, 8), (128, 128, 64, 8, 4, 8),
         (128, 128, 64, 8, 3, 16), (64, 128, 64, 4, 4, 8), (128, 64, 64, 4, 3, 8), (256, 64, 64, 8, 3, 8)]
GRAPH_CASES = [("qwen2.5-0.5b", 24, (16, 64)), ("llama3-8b", 6, (64,))]  # model, layers, rows
SMALL_PLANS = [(64, 32, 128, 4, 3, 8), (64, 16, 128, 4, 4, 8), (64, 32, 64, 4, 4, 8), (64, 64, 64, 4, 4, 8)]


def decode_graphs() -> list[dict]:
    """Per layer, in a CUDA graph over `layers` layers' weights: cuBLAS + SiLU kernel vs the fused kernel."""
    import torch

    from kernels import fused
    from kernels import gate_up as gu

    rows = []
    for model, layers, ms in GRAPH_CASES:
        K, I = MODELS[model]
        ws = [(torch.randn(2 * I, K, device="cuda") / K ** 0.5).bfloat16() for _ in range(layers)]
        for M in ms:
            xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(layers)]
            mm = torch.empty(M, 2 * I, device="cuda", dtype=torch.bfloat16)
            p = gu.plan(M, I, K)
            unfused = graph_us(lambda: [fused.silu_and_mul(torch.mm(x, w.t(), out=mm), pdl=True)
                                        for x, w in zip(xs, ws)], per=layers)
            fused_us = graph_us(lambda: [gu.gate_up_silu(x, w, p) for x, w in zip(xs, ws)], per=layers)
            rows.append({"model": model, "M": M, "layers": layers, "plan": str(p), "unfused_us": unfused,
                         "fused_us": fused_us, "speedup": unfused / fused_us})
            print(f"graph {model:13s} M={M:3d} ({layers} layers): cuBLAS+silu {unfused:6.2f} us/layer, "
                  f"fused {fused_us:6.2f} ({unfused / fused_us:.2f}x)", flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton

    from kernels import fused
    from kernels import gate_up as gu

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    rows = []
    for model, M in SHAPES:
        K, I = MODELS[model]
        g = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(2 * I, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        mm_out = torch.empty(M, 2 * I, device="cuda", dtype=torch.bfloat16)
        expect = fused.silu_and_mul(torch.mm(x, w.t()))
        flops = 2 * M * 2 * I * K
        t_mm = triton.testing.do_bench(lambda: torch.mm(x, w.t(), out=mm_out), return_mode="median")
        t_unfused = triton.testing.do_bench(lambda: fused.silu_and_mul(torch.mm(x, w.t(), out=mm_out)),
                                            return_mode="median")
        row = {"model": model, "M": M, "K": K, "I": I, "cublas_gemm_us": t_mm * 1e3,
               "unfused_us": t_unfused * 1e3, "cublas_tflops": flops / t_mm / 1e9, "plans": []}
        default = gu.plan(M, I, K)
        row["picked"] = None if default is None else str(default)
        plans = [gu.Plan(*p) for p in (SMALL_PLANS if M <= 64 else PLANS)]
        if default is not None and default not in plans:
            plans.insert(0, default)
        for p in plans:
            try:
                got = gu.gate_up_silu(x, w, p)
                err = ((got.float() - expect.float()).abs().max() / expect.float().abs().max()).item()
                t = triton.testing.do_bench(lambda: gu.gate_up_silu(x, w, p), return_mode="median")
            except Exception as e:  # a plan that does not fit (shared memory): recorded, not fatal
                row["plans"].append({"plan": str(p), "error": str(e).splitlines()[0][:200]})
                continue
            row["plans"].append({"plan": str(p), "default": p == default, "us": t * 1e3,
                                 "tflops": flops / t / 1e9, "speedup_vs_unfused": t_unfused / t,
                                 "max_rel_err": err})
        best = min((r for r in row["plans"] if "us" in r), key=lambda r: r["us"])
        d = next((r for r in row["plans"] if r.get("default")), None)
        picked = "unfused" if d is None else f"{d['us']:7.1f} ({d['speedup_vs_unfused']:.2f}x)"
        print(f"{model:13s} M={M:5d}: cuBLAS {t_mm * 1e3:7.1f} us ({row['cublas_tflops']:.0f} TF/s), "
              f"+silu {t_unfused * 1e3:7.1f}; plan() picks {picked}; best {best['us']:7.1f} "
              f"({best['speedup_vs_unfused']:.2f}x) {best['plan']} err {best['max_rel_err']:.1e}", flush=True)
        rows.append(row)
    graphs = decode_graphs()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gate-up-{slug(gpu)}.json"
    write_json(path, gpu_and_date() | {"torch": torch.__version__, "triton": triton.__version__, "rows": rows,
                                        "decode_graphs": graphs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
