"""Matmuls of 64 to ~768 rows (a mixed step's) against their own roofline: `python -m lab.mid_gemm
--out F`.

For Llama-3-8B at TP=1 and Llama-3-70B at TP=2 (one rank's weights, lab/tp_linear.py's shapes; with
`--cases qwen2.5-0.5b:1` a small model's), each projection at each row count: cuBLAS as torch calls
it, cuBLASLt (torch's preferred BLAS library switched), and with --triton lab/splitk_gemm.py's
split-K TMA kernel at each of its plans (the best kept, each checked against cuBLAS); each against
max(FLOPs / matmul rate, bytes / copy bandwidth), both measured in the same call (bench/hardware.py;
the matmul rate is the sustained one since 2026-11-27, the figures of that day's first table are
against the cold burst's, ~1.17x it). Each time is per layer of one CUDA graph that runs the matmul
over --layers copies of the weight in turn, as a step does: the weights come from memory, not L2,
and the host's launches are out of the time (the do_bench figures of 2026-11-27 carried ~5 us of
launch gap at small shapes). Writes one JSON with the GPU and the date.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.forward_curve import fastest_plan
from lab.tp_linear import shapes

ROWS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768)


def run(cases: list[tuple[str, int]], rows: tuple[int, ...], with_triton: bool = False, layers: int = 6,
        path: Path | None = None) -> dict:
    """-> the result, also written to path after every row (a time limit keeps what was measured)."""
    import torch
    from torch.nn import functional as F

    from bench.hardware import measure
    from lab.kernels import gpu_and_date, graph_us

    hw = measure()
    bandwidth, rate = hw.copy_bandwidth, hw.matmul_flops
    out = gpu_and_date() | {"copy_bandwidth": bandwidth, "matmul_rate": rate, "layers": layers, "timing": "cuda graph",
                            "gemms": []}
    print(f"{out['gpu']}: {bandwidth / 1e12:.2f} TB/s, {rate / 1e12:.0f} TFLOP/s", flush=True)
    default = torch.backends.cuda.preferred_blas_library()
    for model, tp in cases:
        for name, (n, k) in shapes(model, tp).items():
            ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for _ in range(layers)]

            def timer(f):
                return graph_us(lambda: [f(w) for w in ws], rep=100, per=layers) / 1e3

            for m in rows:
                x = torch.randn(m, k, device="cuda").bfloat16()
                bound_ms = max(2 * m * n * k / rate, 2 * (n * k + m * k + m * n) / bandwidth) * 1e3
                row = {"model": model, "tp": tp, "proj": name, "M": m, "N": n, "K": k, "bound_ms": bound_ms,
                       "cublas_ms": timer(lambda w: F.linear(x, w))}
                ref = F.linear(x, ws[0])
                torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    torch.testing.assert_close(F.linear(x, ws[0]), ref, atol=0.05, rtol=0.02)
                    row["cublaslt_ms"] = timer(lambda w: F.linear(x, w))
                finally:
                    torch.backends.cuda.preferred_blas_library(default)
                if with_triton:
                    from lab import splitk_gemm

                    row.update(fastest_plan(splitk_gemm.matmul, splitk_gemm.CANDIDATES, x, ws[0], "triton",
                                            "triton_plan", timer=timer))
                best = min(v for key, v in row.items() if key.endswith("_ms") and key != "bound_ms")
                row["best_of_bound"] = row["bound_ms"] / best
                row["cublas_of_bound"] = row["bound_ms"] / row["cublas_ms"]
                out["gemms"].append(row)
                if path is not None:
                    path.write_text(json.dumps(out, indent=1))
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            ws.clear()  # the weights freed before the next projection's
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", default="llama3-8b:1,llama3-70b:2", help="model:tp, comma-separated")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--layers", type=int, default=6, help="weight copies a graph runs through (beyond L2)")
    p.add_argument("--triton", action="store_true", help="also lab/splitk_gemm.py's split-K kernel")
    args = p.parse_args(argv)
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    rows = tuple(int(r) for r in args.rows.split(","))
    run(cases, rows, args.triton, args.layers, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
