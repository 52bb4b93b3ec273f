"""FP8 projections against the 16-bit ones and against their own roofline: `python -m lab.fp8_gemm
--out F [--rows 1,64,512] [--model llama3-8b]`.

For each projection of the model (lab/tp_linear.py's shapes) and row count: the engine's 16-bit
path (kernels/linear.py: the skinny kernel or cuBLAS), kernels/fp8.py's fp8_linear with per-channel
and with 128 x 128 block scales (the input's quantization included), and torch._scaled_mm with
row-wise scales (cuBLASLt's FP8 GEMM, the input quantized by kernels/fp8.py) as a reference for
what the FP8 tensor cores give. Each time is per layer of one CUDA graph over --layers copies of
the weight in turn, so the weights come from memory. The bound: max(FLOPs / (2 x the measured bf16
matmul rate), weight and activation bytes / copy bandwidth). Writes one JSON with the GPU and date.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def run(model: str, rows: list[int], layers: int, path: Path | None) -> dict:
    import torch

    from bench.hardware import measure
    from engine.quant import quantize_weight
    from kernels import fp8, linear, reference
    from lab.kernels import gpu_and_date, graph_us
    from lab.tp_linear import shapes

    hw = measure()
    bandwidth, rate = hw.copy_bandwidth, hw.matmul_flops
    out = gpu_and_date() | {"model": model, "copy_bandwidth": bandwidth, "matmul_rate_bf16": rate,
                            "fp8_rate_assumed": 2 * rate, "layers": layers, "timing": "cuda graph", "gemms": []}
    print(f"{out['gpu']}: {bandwidth / 1e12:.2f} TB/s, {rate / 1e12:.0f} TFLOP/s bf16", flush=True)
    for name, (n, k) in shapes(model, 1).items():
        w16 = [(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for _ in range(layers)]
        q_channel = [quantize_weight(w, blocked=False) for w in w16]
        q_blocks = [quantize_weight(w, blocked=True) for w in w16]
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            row = {"proj": name, "M": m, "N": n, "K": k}

            def timer(f, ws):
                return graph_us(lambda: [f(w) for w in ws], rep=100, per=layers)

            row["bf16_us"] = timer(lambda w: linear.linear(x, w), w16)
            row["fp8_channel_us"] = timer(lambda ws: fp8.fp8_linear(x, *ws), q_channel)
            row["fp8_blocks_us"] = timer(lambda ws: fp8.fp8_linear(x, *ws), q_blocks)
            for key, (wq, s) in (("channel", q_channel[0]), ("blocks", q_blocks[0])):
                err = (fp8.fp8_linear(x, wq, s).float() - reference.fp8_linear(x, wq, s).float()).abs().max()
                row[f"fp8_{key}_max_err"] = err.item()

            def scaled_mm(ws):
                xq, xs = fp8.quantize(x, k)
                return torch._scaled_mm(xq, ws[0].t(), scale_a=xs, scale_b=ws[1].t(), out_dtype=torch.bfloat16)

            try:
                row["scaled_mm_channel_us"] = timer(scaled_mm, q_channel)
            except RuntimeError as e:  # not every torch build has row-wise scales
                row["scaled_mm_error"] = str(e).splitlines()[0][:200]
            flops, w_bytes = 2 * m * n * k, n * k
            row["fp8_bound_us"] = max(flops / (2 * rate), (w_bytes + 2 * m * k + 2 * m * n) / bandwidth) * 1e6
            row["bf16_bound_us"] = max(flops / rate, (2 * w_bytes + 2 * m * k + 2 * m * n) / bandwidth) * 1e6
            row["fp8_channel_of_bound"] = row["fp8_bound_us"] / row["fp8_channel_us"]
            row["fp8_over_bf16"] = row["fp8_channel_us"] / row["bf16_us"]
            out["gemms"].append(row)
            if path is not None:
                path.write_text(json.dumps(out, indent=1))
            print(json.dumps({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()}), flush=True)
        del w16, q_channel, q_blocks
        torch.cuda.empty_cache()
    return out


def sweep(model: str, rows: list[int], layers: int, path: Path | None) -> dict:
    """kernels/fp8.py's plans for few rows: every (block_n, split, swap, stages) per projection and row
    count, the fastest kept; and the float32 error of each accumulation setting against the reference."""
    import itertools

    import torch

    from engine.quant import quantize_weight
    from kernels import fp8, reference
    from lab.kernels import gpu_and_date, graph_us
    from lab.tp_linear import shapes

    out = gpu_and_date() | {"model": model, "layers": layers, "timing": "cuda graph", "plans": [], "accuracy": []}
    for name, (n, k) in shapes(model, 1).items():
        qs = [quantize_weight((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16(), blocked=False)
              for _ in range(layers)]
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = fp8.quantize(x, k)
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            default = fp8.plan(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
            results = []
            for block_n, split, swap, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (False, True), (4, 6)):
                p = fp8.Plan(max(16, 1 << (m - 1).bit_length()), block_n, split, swap, stages=stages)
                try:
                    us = graph_us(lambda: [fp8.w8a8_matmul(xq, xs, w, s, None, o, p=p) for w, s in qs], rep=50,
                                  per=layers)
                except Exception as e:  # a plan that does not compile (shared memory) is skipped
                    print(f"{name} M={m} {p}: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                results.append((us, p))
            results.sort(key=lambda r: r[0])
            best_us, best = results[0]
            default_us = graph_us(lambda: [fp8.w8a8_matmul(xq, xs, w, s, None, o, p=default) for w, s in qs],
                                  rep=50, per=layers)
            row = {"proj": name, "M": m, "N": n, "K": k, "best_us": best_us, "best": best.__dict__,
                   "default_us": default_us, "default": default.__dict__,
                   "top5": [(round(us, 2), p.__dict__) for us, p in results[:5]],
                   "quantize_us": graph_us(lambda: fp8.quantize(x, k), rep=50)}
            out["plans"].append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "top5"}), flush=True)
            if path is not None:
                path.write_text(json.dumps(out, indent=1))
        w, s = qs[0]
        x = torch.randn(64, k, device="cuda")
        want = reference.fp8_linear(x, w, s).double()
        for imprecise in (-1, 0, 32, 128):
            o = torch.empty(64, n, device="cuda")
            xq, xs = fp8.quantize(x, k)
            p = fp8.Plan(64, 64, 1, False, imprecise=imprecise)
            got = fp8.w8a8_matmul(xq, xs, w, s, None, o, p=p).double()
            rel = ((got - want).norm() / want.norm()).item()
            out["accuracy"].append({"proj": name, "imprecise": imprecise, "relative_error": rel})
            print(f"{name} imprecise={imprecise}: relative error {rel:.3g}", flush=True)
        qs.clear()
        torch.cuda.empty_cache()
    if path is not None:
        path.write_text(json.dumps(out, indent=1))
    return out


def blockwise_probe(path: Path | None) -> dict:
    """Whether this torch's _scaled_mm multiplies with 1 x 128 input and 128 x 128 weight block scales,
    and how fast, against kernels/fp8.py (Llama-3-8B's gate_up at 2,048 rows)."""
    import torch

    from engine.quant import quantize_weight
    from kernels import fp8, reference
    from lab.kernels import gpu_and_date, graph_us

    n, k, m = 28672, 4096, 2048
    w, s = quantize_weight(torch.randn(n, k, device="cuda").bfloat16() / 64, blocked=True)
    x = torch.randn(m, k, device="cuda").bfloat16()
    xq, xs = fp8.quantize(x, 128)
    want = reference.fp8_linear(x, w, s).float()
    out = gpu_and_date() | {"torch": torch.__version__, "tries": []}
    layouts = {"a [M,K/128] col-major, b [N/128,K/128] row-major": (xs.t().contiguous().t(), s.t()),
               "a [M,K/128] row-major, b [N/128,K/128] row-major": (xs, s.t()),
               "a col-major, b [K/128,N/128] row-major": (xs.t().contiguous().t(), s.t().contiguous())}
    for label, (sa, sb) in layouts.items():
        try:
            got = torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
            err = ((got - want).norm() / want.norm()).item()
            us = graph_us(lambda: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            out["tries"].append({"layout": label, "relative_error": err, "us": us})
        except Exception as e:
            out["tries"].append({"layout": label, "error": str(e).splitlines()[0][:300]})
    out["triton_us"] = graph_us(lambda: fp8.fp8_linear(x, w, s))
    print(json.dumps(out, indent=1), flush=True)
    if path is not None:
        path.write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--rows", default="1,16,64,128,256,512,2048")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path)
    p.add_argument("--sweep", action="store_true", help="the few-row plans and accumulation settings instead")
    p.add_argument("--blockwise-probe", action="store_true", help="torch._scaled_mm with block scales instead")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.blockwise_probe:
        blockwise_probe(args.out)
    elif args.sweep:
        sweep(args.model, rows, args.layers, args.out)
    else:
        run(args.model, rows, args.layers, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
