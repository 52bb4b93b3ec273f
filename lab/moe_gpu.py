"""The fused MoE layer (kernels/moe.py) on a GPU at Qwen3-30B-A3B's shape: `python -m lab.moe_gpu --out F`.

Hidden 2048, 128 experts, top 8, expert width 768, bf16, random weights and uniform random routing.
- decode, batch 64: the layer (align + both grouped matmuls + the sum) and the two matmuls alone,
  replayed in a CUDA graph over several layers' experts in turn (each layer's 1.2 GB of experts
  is far beyond L2, as in a decode step); bytes = the experts the batch really touches (distinct
  ids) plus x and the output; the fraction of the measured copy bandwidth (target >= 70%).
- prefill, 4,096 tokens: FLOPs of the active experts (2 x T x k x 3 x hidden x width); the
  fraction of the measured bf16 matmul rate (a torch.matmul probe, bench/hardware.py; target >= 60%);
  also 16,384 tokens with plan()'s tiles (4,096 sits at the ridge point: 256 rows per expert).
- a few tile plans at each size beside plan()'s pick, to tune it.
- the Triton output against the torch reference (kernels/moe_reference.py) at both sizes, and a
  CUDA graph's replay on new inputs against an eager call (the layer captures: no host syncs).
- --engine: also `LLM(model="qwen3-30b-a3b", load_format="dummy")` on this GPU (start-up, KV blocks,
  64 prompts x 512 tokens -> 32 tokens each, tok/s); a few minutes more.
Writes one JSON with the GPU's name and the date to --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
DECODE_T, PREFILL_T = 64, 4096
LAYERS = 4  # the decode graph cycles over this many layers' experts (4.8 GB)
# (block_m, block_n, block_k, num_warps, num_stages)
DECODE_PLANS = [(16, 32, 128, 4, 4), (16, 128, 64, 4, 4), (16, 64, 256, 4, 3), (16, 64, 128, 8, 5)]
PREFILL_PLANS = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 8, 3), (64, 64, 64, 4, 3)]
# at 4,096 tokens an expert gets 256 rows: 256 FLOP per weight byte, about the H100's ridge point,
# so the experts' weights must stream at the copy bandwidth too; 16,384 tokens is compute bound
PREFILL_LONG_T = 16384


def _inputs(t: int, seed: int):
    import torch

    from kernels.moe_reference import route
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(t, HIDDEN, device="cuda", generator=g)).bfloat16()
    weights, ids = route(torch.randn(t, EXPERTS, device="cuda", generator=g), TOP_K, renormalize=True)
    return x, weights, ids


def _layer_weights(seed: int):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda", generator=g) * WIDTH ** -0.5).bfloat16()
    return w13, w2


def _graph_us(fn, per: int) -> float:
    import torch
    import triton
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3 / per


def _rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def decode(layers, copy_bw: float) -> dict:
    import torch

    from kernels import moe
    x, weights, ids = _inputs(DECODE_T, 1)
    touched = int(torch.unique(ids).numel())
    expert_bytes = 3 * HIDDEN * WIDTH * 2
    nbytes = touched * expert_bytes + 2 * DECODE_T * HIDDEN * 2
    out = {"tokens": DECODE_T, "experts_touched": touched, "bytes_per_layer": nbytes, "plan": str(moe.plan(DECODE_T, TOP_K, EXPERTS))}
    plans = []
    for cfg in [None, *DECODE_PLANS]:
        p = moe.Plan(*cfg) if cfg else moe.plan(DECODE_T, TOP_K, EXPERTS)
        sorted_ids, block_expert = moe.align(ids, EXPERTS, 0, p.block_m)
        us_layer = _graph_us(lambda: [moe.fused_moe(x, w13, w2, weights, ids, p=p) for w13, w2 in layers], LAYERS)
        us_kernels = _graph_us(lambda: [moe.experts(x, w13, w2, weights, sorted_ids, block_expert, p)
                                        for w13, w2 in layers], LAYERS)
        row = {"plan": str(p), "picked": cfg is None, "layer_us": us_layer, "kernels_us": us_kernels,
               "layer_fraction_of_copy_bw": nbytes / (us_layer * 1e-6) / copy_bw,
               "kernels_fraction_of_copy_bw": nbytes / (us_kernels * 1e-6) / copy_bw}
        plans.append(row)
        print(f"decode T={DECODE_T} {row['plan']}: layer {us_layer:7.1f} us ({row['layer_fraction_of_copy_bw']:.0%} of copy bw), "
              f"matmuls {us_kernels:7.1f} us ({row['kernels_fraction_of_copy_bw']:.0%})", flush=True)
    align_us = _graph_us(lambda: [moe.align(ids, EXPERTS, 0, 16) for _ in range(LAYERS)], LAYERS)
    print(f"decode align alone: {align_us:.1f} us", flush=True)
    best = max(plans, key=lambda r: r["layer_fraction_of_copy_bw"])
    return {**out, "align_us": align_us, "plans": plans, "picked": plans[0], "best": best,
            "target_fraction": 0.70, "meets_target": plans[0]["layer_fraction_of_copy_bw"] >= 0.70}


def prefill(w13, w2, matmul_flops: float) -> dict:
    from kernels import moe
    x, weights, ids = _inputs(PREFILL_T, 2)
    flops = 2.0 * PREFILL_T * TOP_K * 3 * HIDDEN * WIDTH
    plans = []
    for cfg in [None, *PREFILL_PLANS]:
        p = moe.Plan(*cfg) if cfg else moe.plan(PREFILL_T, TOP_K, EXPERTS)
        sorted_ids, block_expert = moe.align(ids, EXPERTS, 0, p.block_m)
        us_layer = _graph_us(lambda: moe.fused_moe(x, w13, w2, weights, ids, p=p), 1)
        us_kernels = _graph_us(lambda: moe.experts(x, w13, w2, weights, sorted_ids, block_expert, p), 1)
        row = {"plan": str(p), "picked": cfg is None, "layer_us": us_layer, "kernels_us": us_kernels,
               "layer_fraction_of_matmul": flops / (us_layer * 1e-6) / matmul_flops,
               "kernels_fraction_of_matmul": flops / (us_kernels * 1e-6) / matmul_flops}
        plans.append(row)
        print(f"prefill T={PREFILL_T} {row['plan']}: layer {us_layer:7.1f} us ({row['layer_fraction_of_matmul']:.0%} of matmul), "
              f"matmuls {us_kernels:7.1f} us ({row['kernels_fraction_of_matmul']:.0%})", flush=True)
    best = max(plans, key=lambda r: r["layer_fraction_of_matmul"])
    x, weights, ids = _inputs(PREFILL_LONG_T, 3)
    long_flops = 2.0 * PREFILL_LONG_T * TOP_K * 3 * HIDDEN * WIDTH
    p = moe.plan(PREFILL_LONG_T, TOP_K, EXPERTS)
    us_long = _graph_us(lambda: moe.fused_moe(x, w13, w2, weights, ids, p=p), 1)
    long = {"tokens": PREFILL_LONG_T, "plan": str(p), "layer_us": us_long,
            "layer_fraction_of_matmul": long_flops / (us_long * 1e-6) / matmul_flops}
    print(f"prefill T={PREFILL_LONG_T} {p}: layer {us_long:7.1f} us ({long['layer_fraction_of_matmul']:.0%} of matmul)",
          flush=True)
    return {"tokens": PREFILL_T, "flops": flops, "plans": plans, "picked": plans[0], "best": best, "long": long,
            "target_fraction": 0.60, "meets_target": plans[0]["layer_fraction_of_matmul"] >= 0.60}


def correctness(w13, w2) -> dict:
    """Triton against the torch reference (bf16), eager and replayed from a CUDA graph on new inputs."""
    import torch

    from kernels import moe
    from kernels import moe_reference as ref
    res = {}
    for t in (DECODE_T, PREFILL_T, 3):
        x, weights, ids = _inputs(t, 10 + t)
        res[f"rel_err_T{t}"] = _rel_err(moe.fused_moe(x, w13, w2, weights, ids), ref.fused_moe(x, w13, w2, weights, ids))
    # expert parallel: a rank with the second half of the experts
    x, weights, ids = _inputs(DECODE_T, 5)
    half = EXPERTS // 2
    part = moe.fused_moe(x, w13[half:], w2[half:], weights, ids, half, EXPERTS)
    res["rel_err_expert_parallel_half"] = _rel_err(part, ref.fused_moe(x, w13[half:], w2[half:], weights, ids, half))
    # capture, then replay on other tokens and routing
    x, weights, ids = _inputs(DECODE_T, 6)
    moe.fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, weights, ids)
    x2, weights2, ids2 = _inputs(DECODE_T, 7)
    for static, new in ((x, x2), (weights, weights2), (ids, ids2)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    res["rel_err_graph_replay"] = _rel_err(out, ref.fused_moe(x2, w13, w2, weights2, ids2))
    res["ok"] = all(v < 1.5e-2 for v in res.values())
    print("correctness:", res, flush=True)
    return res


def engine() -> dict:
    """The engine with the Qwen3-30B-A3B preset and dummy weights on this GPU."""
    from serve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM("qwen3-30b-a3b", load_format="dummy", max_model_len=4096)
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    prompts = [[(i * 131 + j * 7) % 150000 + 10 for j in range(512)] for i in range(64)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    res = {"startup_s": start_s, "startup_phases_s": runner.startup_s, "num_kv_blocks": runner.num_blocks,
           "generate_s": gen_s, "output_tok_s": sum(len(o.token_ids) for o in outs) / gen_s}
    print("engine:", res, flush=True)
    llm.shutdown()
    return res


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton

    from bench.hardware import measure

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    ap.add_argument("--engine", action="store_true", help="also serve the preset through LLM (a few minutes)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    hw = measure()
    if hw.error or not hw.copy_bandwidth:
        raise SystemExit(f"measuring the GPU failed: {hw.error}")
    print(f"{hw.device}: copy {hw.copy_bandwidth / 1e12:.2f} TB/s, bf16 matmul {hw.matmul_flops / 1e12:.0f} TFLOP/s", flush=True)
    layers = [_layer_weights(i) for i in range(LAYERS)]
    result = {"gpu": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(),
              "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "width": WIDTH, "dtype": "bfloat16"},
              "copy_bandwidth": hw.copy_bandwidth, "matmul_flops": hw.matmul_flops}
    result["correctness"] = correctness(*layers[0])
    result["decode"] = decode(layers, hw.copy_bandwidth)
    result["prefill"] = prefill(*layers[0], hw.matmul_flops)
    del layers
    torch.cuda.empty_cache()
    if args.engine:
        result["engine"] = engine()
    result["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"decode {result['decode']['picked']['layer_fraction_of_copy_bw']:.0%} of copy bandwidth (target 70%), "
          f"prefill {result['prefill']['picked']['layer_fraction_of_matmul']:.0%} of the matmul rate (target 60%); "
          f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
