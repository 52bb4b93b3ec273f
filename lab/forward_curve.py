"""The forward's device time against its rows, finely, and each projection's matmul against its own
roofline: where a mixed step (64 to ~1,000 rows) loses the overlap of compute and weight reads.

    python -m lab.forward_curve --model .models/llama3-8b --out curve.json [--triton]

Forwards run eagerly as the start-up cost model runs them (prompt chunks of 256, writing no KV), at
16, 32 and every 64 rows to 1,024. Each projection (qkv, o, gate_up, down) is timed alone with
cuBLAS (and with --triton, lab/tma_gemm.py's persistent TMA kernel at a few tile shapes, the best
kept; with --split-k, cuBLAS over K split in 2, 3 or 4 as one batched GEMM with float32 outputs
summed after it, the best kept, and cuBLAS on the rows padded to a multiple of 128) against
max(FLOPs / matmul rate, bytes / copy bandwidth), both measured in the same call. Split-K is for
the projections with few columns (qkv, o), whose output tiles at 128-512 rows leave SMs idle.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.forward_curve")
    p.add_argument("--model", required=True, help="a model folder (dummy weights)")
    p.add_argument("--out", required=True)
    p.add_argument("--triton", action="store_true", help="also lab/tma_gemm.py's persistent kernel")
    p.add_argument("--split-k", action="store_true", help="also cuBLAS over split K, and on padded rows")
    p.add_argument("--rows", default="16,32," + ",".join(str(m) for m in range(64, 1025, 64)))
    args = p.parse_args(argv)

    import torch
    import triton.testing
    from torch.nn import functional as F

    from bench.hardware import measure
    from engine.config import EngineConfig, ModelConfig
    from engine.runner import ModelRunner, _device_ms
    from lab.kernels import gpu_and_date
    from kvcache.pool import KVPool

    path = Path(args.model)
    model_cfg = ModelConfig.from_path(path)
    cfg = EngineConfig(model=str(path), load_format="dummy", enforce_eager=True, num_kv_blocks=64)
    runner = ModelRunner(model_cfg, path, cfg, 2048, show_progress=False)
    rows = [int(r) for r in args.rows.split(",")]
    pool = KVPool(runner.kv_spec, 1, runner.device, runner.dtype)
    forward = {n: _device_ms(runner._forward_fn(n, pool), repeats=5) for n in rows}
    del pool

    hw = measure()  # serve bench's own copy bandwidth and matmul rate
    bandwidth, rate = hw.copy_bandwidth, hw.matmul_flops

    layer = runner.model.layers[0]
    weights = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
               "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight}
    tma = None
    if args.triton:
        from lab import tma_gemm
        tma = tma_gemm
    gemms = []
    for name, w in weights.items():
        N, K = w.shape
        for m in rows:
            xm = torch.randn(m, K, dtype=w.dtype, device="cuda")
            bound_ms = max(2 * m * N * K / rate, 2 * (N * K + m * K + m * N) / bandwidth) * 1e3
            row = {"proj": name, "M": m, "N": N, "K": K, "bound_ms": bound_ms,
                   "cublas_ms": triton.testing.do_bench(lambda: F.linear(xm, w), rep=60)}
            if tma is not None and m >= 64:
                row.update(fastest_plan(tma.matmul, tma.CANDIDATES, xm, w, "tma", "tma_tiles"))
            if args.split_k and m >= 64:
                row.update(split_k_rows(xm, w))
            row["cublas_of_bound"] = row["bound_ms"] / row["cublas_ms"]
            gemms.append(row)
            print(json.dumps(row), flush=True)

    result = gpu_and_date() | {"model": path.name, "copy_bandwidth": bandwidth, "matmul_rate": rate,
                               "forward_ms": forward, "gemms": gemms}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("forward ms:", {k: round(v, 2) for k, v in forward.items()})
    return 0


def fastest_plan(matmul, plans, x, w, name: str, plan_key: str, timer=None) -> dict:
    """matmul(x, w, plan) at every plan, each checked against cuBLAS -> {name_ms: the fastest's
    time, plan_key: its plan, name_errors: the plans that failed (shared memory, K)}.
    timer(f) -> ms times f(weight) (default: triton's do_bench of f(w))."""
    import torch
    import triton.testing
    from torch.nn import functional as F

    if timer is None:
        def timer(f):
            return triton.testing.do_bench(lambda: f(w), rep=60)
    ref = F.linear(x, w)
    out: dict = {}
    for plan in plans:
        try:
            torch.testing.assert_close(matmul(x, w, plan), ref, atol=0.05, rtol=0.02)
            ms = timer(lambda wi, plan=plan: matmul(x, wi, plan))
        except Exception as e:  # noqa: BLE001 - a plan that does not fit this GPU is a result
            out.setdefault(f"{name}_errors", []).append(f"{plan}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if f"{name}_ms" not in out or ms < out[f"{name}_ms"]:
            out[f"{name}_ms"], out[plan_key] = ms, list(plan)
    return out


def split_k_rows(x, w) -> dict:
    """cuBLAS on x [M, K] @ w [N, K].T as S batched GEMMs over K / S (float32 outputs, summed, then
    rounded once), the best S of 2-4; and on x's rows padded to a multiple of 128."""
    import torch
    import triton.testing
    from torch.nn import functional as F

    m, k = x.shape
    n = w.shape[0]
    ref = F.linear(x, w)
    out = {}
    for s in (2, 3, 4):
        if k % (s * 64):
            continue
        xs = x.view(m, s, k // s).transpose(0, 1)
        ws = w.view(n, s, k // s).permute(1, 2, 0)

        def fn(xs=xs, ws=ws):
            return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(x.dtype)
        try:
            torch.testing.assert_close(fn(), ref, atol=0.05, rtol=0.02)
            ms = triton.testing.do_bench(fn, rep=60)
        except Exception as e:  # noqa: BLE001 - a torch without bmm's out_dtype: a result too
            out.setdefault("split_k_errors", []).append(f"{s}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if "split_k_ms" not in out or ms < out["split_k_ms"]:
            out["split_k_ms"], out["split_k"] = ms, s
    padded = -(-m // 128) * 128
    if padded != m:
        xp = torch.zeros(padded, k, dtype=x.dtype, device=x.device)
        xp[:m] = x
        out["pad128_ms"] = triton.testing.do_bench(lambda: F.linear(xp, w), rep=60)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
