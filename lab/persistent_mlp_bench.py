"""The persistent MLP kernel (lab/persistent_mlp.py) against the engine's decode MLP block:
`python -m lab.persistent_mlp_bench [--rows 16,64] [--quick] [--json OUT]`.

Per layer, timed in one CUDA graph over every layer's own weights in turn (cold L2, as a decode
step sees them; triton's do_bench_cudagraph, median): the unfused block as the engine runs it
(add + RMSNorm, kernels/gate_up.py's fused gate/up + SiLU, the skinny down projection) against
the persistent kernel at its plan and at the variants below (one change each; with Plan.norm False
its input comes normed, the two matmuls alone; phases (1,) or (2,) time one phase, whose phase B
alone reads stale activations), each checked against the reference first.
The floor is the layer's weight bytes at the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import dataclasses

MODELS = {"qwen2.5-0.5b": (896, 4864, 24), "smollm2-135m": (576, 1536, 30)}  # hidden, intermediate, layers


def variants(base):
    """The plan and one change at a time."""
    r = dataclasses.replace
    w4 = r(base, num_warps=4)
    return [("plan", base, None), ("atomic spin", r(base, spin=0), None), ("4 warps", w4, None),
            ("4w no prefetch", r(w4, prefetch=False), None), ("4w 4 stages", r(w4, num_stages=4), None),
            ("4w down n 32", r(w4, d_block_n=32, splits=base.splits // 2), None),
            ("4w down k 128", r(w4, d_block_k=128), None),
            ("4w phase A", w4, (1,)), ("4w phase B", w4, (2,)), ("4w A, B apart", w4, (1, 2)),
            ("4w no norm", r(w4, norm=False), None), ("4w no norm A", r(w4, norm=False), (1,)),
            ("8w no norm A", r(base, norm=False), (1,)),
            ("4w B n32", r(w4, d_block_n=32, splits=base.splits // 2), (2,)),
            ("4w B n32 k128", r(w4, d_block_n=32, splits=base.splits // 2, d_block_k=128), (2,)),
            ("4w B n16", r(w4, d_block_n=16, splits=max(1, base.splits // 4)), (2,))]


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton

    from kernels.fused import rms_norm
    from kernels.gate_up import mlp_gate_up
    from kernels.launch import sm_count
    from kernels.linear import linear
    from lab import persistent_mlp as fm
    from lab.kernels import copy_bandwidth, gpu_and_date, graph_us, write_json

    ap = argparse.ArgumentParser(prog="python -m lab.persistent_mlp_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--quick", action="store_true", help="the plan and two variants only")
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    sms = sm_count(torch.device("cuda"))
    print(f"{gpu}: {sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    out = []
    for model, (H, I, layers) in MODELS.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        wgu = [(torch.randn(2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16() for _ in range(layers)]
        wd = [(torch.randn(H, I, device="cuda", generator=g) / I ** 0.5).bfloat16() for _ in range(layers)]
        nw = [(1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16() for _ in range(layers)]
        floor = 3 * H * I * 2 / bw * 1e6
        for M in (int(m) for m in a.rows.split(",")):
            xs = [torch.randn(M, H, device="cuda", generator=g).bfloat16() for _ in range(layers)]
            rs = [torch.randn(M, H, device="cuda", generator=g).bfloat16() for _ in range(layers)]

            def unfused():
                for i in range(layers):
                    h, _ = rms_norm(xs[i], nw[i], 1e-6, rs[i])
                    linear(mlp_gate_up(h, wgu[i]), wd[i])

            base_us = graph_us(unfused, per=layers)
            row = {"model": model, "rows": M, "layers": layers, "floor_us": floor, "unfused_us": base_us,
                   "variants": []}
            print(f"{model} M={M}: unfused {base_us:.2f} us/layer (floor {floor:.2f})", flush=True)
            cases = variants(fm.plan(M, H, I, sms))
            for name, p, phases in cases[:3] if a.quick else cases:
                got, _ = fm.fused_mlp(xs[0], rs[0], nw[0], 1e-6, wgu[0], wd[0], p, phases)
                if p.norm:
                    ref, _ = fm.reference_mlp(xs[0], rs[0], nw[0], 1e-6, wgu[0], wd[0])
                else:
                    ref = linear(mlp_gate_up(xs[0], wgu[0]), wd[0])
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                us = graph_us(lambda: [fm.fused_mlp(xs[i], rs[i], nw[i], 1e-6, wgu[i], wd[i], p, phases)
                                       for i in range(layers)], per=layers)
                row["variants"].append({"name": name, "plan": str(p), "phases": phases, "us": us, "rel_err": err})
                print(f"  {name:12s} {us:6.2f} us/layer ({base_us / us:.2f}x unfused, {us / floor:.2f}x floor) "
                      f"err {err:.1e}  {p}", flush=True)
            out.append(row)
        wgu = wd = xs = rs = None  # free before the next model
        torch.cuda.empty_cache()
    write_json(a.json, gpu_and_date() | {"sms": sms, "copy_bandwidth": bw, "torch": torch.__version__,
                                         "triton": triton.__version__, "rows": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
