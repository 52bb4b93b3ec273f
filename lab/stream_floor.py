"""How fast a kernel can read N bytes from HBM in a CUDA graph, by grid and loads in flight, beside
the engine's decode kernels that must read the same bytes: the floor under a small model's decode
step, kernel by kernel.

    python -m lab.stream_floor [--json OUT] [--quick] [--engine-only]

The engine's Qwen2.5-0.5B decode kernels at 64 rows read 1.6-17.4 MB each and stream them at a
third to a half of the copy bandwidth (bench/NOTES.md, 2026-11-24/27), one program an SM with few
warps. This asks what any kernel of that size can do: a plain read-and-sum kernel (vector loads,
BLOCK elements a program per iteration) and a TMA one (tensor-descriptor tiles pipelined by
Triton), each over a sweep of programs and warps, every launch reading its own copy of the bytes
(cold L2), in a graph of back-to-back launches as a decode step runs them. Then the engine's own
kernel of each size in the same call. Reports each size's best stream, its plan, the engine's time
and the sum over a layer.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import math
import sys

import torch
import triton
import triton.language as tl

from kernels.launch import TensorDescriptor, sm_count
from lab.kernels import cold_copies, copy_bandwidth, decode_inputs, gpu_and_date, graph_time, write_json

# Qwen2.5-0.5B at 64 rows, 576-token contexts: (name, bytes the kernel must read)
QWEN = dict(H=896, I=4864, Hq=14, Hkv=2, D=64, B=64, ctx=576, bs=16)


def layer_sizes(c: dict) -> list[tuple[str, int]]:
    H, I, D, Hq, Hkv = c["H"], c["I"], c["D"], c["Hq"], c["Hkv"]
    kv = 2 * c["B"] * c["ctx"] * Hkv * D * 2
    return [("qkv", (Hq + 2 * Hkv) * D * H * 2), ("attention KV", kv), ("o", H * Hq * D * 2),
            ("gate_up", 2 * I * H * 2), ("down", H * I * 2)]


@triton.jit
def _stream_kernel(src, out, chunk, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * chunk
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, chunk, BLOCK):
        p = lo + i + offs
        acc += tl.load(src + p, mask=p < n, other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


@triton.jit
def _tma_kernel(desc, out, rows_per, ROWS: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    r0 = pid * rows_per
    acc = tl.zeros([ROWS, COLS], tl.float32)
    for r in tl.range(r0, r0 + rows_per, ROWS, num_stages=STAGES):
        acc += desc.load([r, 0]).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def stream_cases(quick: bool) -> list[dict]:
    sms = sm_count(torch.device("cuda"))
    cases = []
    per_sm = (1, 2, 4) if quick else (1, 2, 4, 8)
    for k, warps, block in itertools.product(per_sm, (4, 8), (2048, 8192)):
        cases.append({"kind": "ld", "programs": k * sms, "num_warps": warps, "block": block})
    for k, warps, rows, stages in itertools.product(per_sm, (4,), (32, 64), (3, 5)):
        cases.append({"kind": "tma", "programs": k * sms, "num_warps": warps, "rows": rows, "stages": stages})
    return cases


def time_stream(nbytes: int, case: dict) -> float:
    """Seconds a launch of `case` takes to read nbytes (bf16), each launch of the graph its own copy."""
    n = nbytes // 2
    copies = cold_copies(nbytes)
    out = torch.empty(case["programs"], device="cuda", dtype=torch.float32)
    if case["kind"] == "ld":
        chunk = triton.cdiv(triton.cdiv(n, case["programs"]), case["block"]) * case["block"]
        bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

        def fn(i):
            _stream_kernel[(case["programs"],)](bufs[i], out, chunk, n, BLOCK=case["block"],
                                                num_warps=case["num_warps"])
    else:
        cols, rows = 128, case["rows"]
        total_rows = triton.cdiv(n, cols)
        rows_per = triton.cdiv(triton.cdiv(total_rows, case["programs"]), rows) * rows
        bufs = [torch.randn(total_rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        descs = [TensorDescriptor(b, [total_rows, cols], [cols, 1], [rows, cols]) for b in bufs]

        def fn(i):
            _tma_kernel[(case["programs"],)](descs[i], out, rows_per, ROWS=rows, COLS=cols,
                                             STAGES=case["stages"], num_warps=case["num_warps"])
    return graph_time(fn, copies)


def engine_times(c: dict, hot: bool = False) -> dict[str, float]:
    """Seconds per call of the engine's decode kernel of each size, M = B rows, cold L2; hot: every
    launch on the same weights and pages, which stay in L2 (what a perfect prefetch would give). The
    add + RMSNorm runs on one 64 x 896 input either way (its weight is 1.8 KB)."""
    from kernels.fused import rms_norm
    from kernels.gate_up import mlp_gate_up
    from kernels.linear import linear
    from kernels.paged_attention import paged_decode_attention

    H, I, D, Hq, Hkv, B = c["H"], c["I"], c["D"], c["Hq"], c["Hkv"], c["B"]
    bf = torch.bfloat16
    res = {}
    for name, N, K, bias in (("qkv", (Hq + 2 * Hkv) * D, H, True), ("o", H, Hq * D, False),
                             ("gate_up", 2 * I, H, False), ("down", H, I, False)):
        copies = cold_copies(N * K * 2)
        ws = [torch.randn(N, K, device="cuda", dtype=bf) * 0.05 for _ in range(1 if hot else copies)]
        bs = [torch.randn(N, device="cuda", dtype=bf) if bias else None for _ in range(len(ws))]
        if hot:
            ws, bs = ws * copies, bs * copies
        x = torch.randn(B, K, device="cuda", dtype=bf)
        if name == "gate_up":
            res[name] = graph_time(lambda i: mlp_gate_up(x, ws[i]), copies)
        else:
            res[name] = graph_time(lambda i: linear(x, ws[i], bs[i]), copies)
    copies = 24
    ins = [decode_inputs(B, c["ctx"], Hq, Hkv, D, c["bs"], None, seed=i) for i in range(1 if hot else copies)]
    ins = ins * (copies // len(ins))
    scale = 1 / math.sqrt(D)
    res["attention KV"] = graph_time(lambda i: paged_decode_attention(*ins[i][0:3], ins[i][5], ins[i][6], scale),
                                     copies)
    x = torch.randn(B, H, device="cuda", dtype=bf)
    r = torch.randn(B, H, device="cuda", dtype=bf)
    w = torch.ones(H, device="cuda", dtype=bf)
    res["add+rmsnorm"] = graph_time(lambda i: rms_norm(x, w, 1e-6, residual=r), 64)
    return res


def engine_hot_cold(path: str | None) -> int:
    """The engine's kernels of a layer with cold and with L2-resident weights and pages, twice each."""
    runs = {name: [] for name in ("cold", "hot")}
    for _ in range(2):
        for name in runs:
            runs[name].append({k: v * 1e6 for k, v in engine_times(QWEN, hot=name == "hot").items()})
    for op in runs["cold"][0]:
        print(f"{op:14s} cold {runs['cold'][0][op]:6.2f} / {runs['cold'][1][op]:6.2f} us, "
              f"hot {runs['hot'][0][op]:6.2f} / {runs['hot'][1][op]:6.2f}", flush=True)
    for name, rs in runs.items():
        print(f"layer {name}: " + " / ".join(f"{sum(r.values()) + r['add+rmsnorm']:.1f}" for r in rs)
              + " us (two norms in)", flush=True)
    write_json(path, gpu_and_date() | {"shape": QWEN, "engine_us": runs})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.stream_floor", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="fewer grid sizes")
    p.add_argument("--engine-only", action="store_true",
                   help="only the engine's kernels, with cold and with hot (L2-resident) weights and pages")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lab.stream_floor: needs a CUDA GPU", file=sys.stderr)
        return 1
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if a.engine_only:
        return engine_hot_cold(a.json)
    sizes = layer_sizes(QWEN)
    sizes.append(("layer, one kernel", sum(s for _, s in sizes)))
    rows = []
    best = {}
    for name, nbytes in sizes:
        for case in stream_cases(a.quick):
            t = time_stream(nbytes, case)
            rows.append({"size": name, "bytes": nbytes, **case, "us": t * 1e6, "of_copy_bw": nbytes / t / bw})
            if name not in best or t < best[name][0]:
                best[name] = (t, case)
        t, case = best[name]
        print(f"{name:18s} {nbytes / 1e6:6.2f} MB: best stream {t * 1e6:6.2f} us "
              f"({nbytes / t / bw:.0%} of copy bw) {case}; at the copy bw {nbytes / bw * 1e6:.2f} us", flush=True)
    eng = engine_times(QWEN)
    summary = []
    for name, nbytes in sizes[:-1]:
        summary.append({"op": name, "bytes": nbytes, "engine_us": eng[name] * 1e6, "stream_us": best[name][0] * 1e6,
                        "stream_plan": best[name][1], "copy_bw_us": nbytes / bw * 1e6})
        print(f"{name:18s} engine {eng[name] * 1e6:6.2f} us, best stream {best[name][0] * 1e6:6.2f}, "
              f"copy bw {nbytes / bw * 1e6:6.2f}", flush=True)
    print(f"add+rmsnorm engine {eng['add+rmsnorm'] * 1e6:.2f} us", flush=True)
    eng_sum = sum(r["engine_us"] for r in summary) + 2 * eng["add+rmsnorm"] * 1e6
    floor_sum = sum(r["stream_us"] for r in summary)
    print(f"layer: engine kernels {eng_sum:.1f} us (two norms in), streams of their bytes {floor_sum:.1f} us, "
          f"one stream of the layer {best['layer, one kernel'][0] * 1e6:.1f} us", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "copy_bw": bw, "shape": QWEN, "streams": rows, "summary": summary,
              "add_rmsnorm_us": eng["add+rmsnorm"] * 1e6, "layer_engine_us": eng_sum, "layer_stream_sum_us": floor_sum,
              "layer_one_stream_us": best["layer, one kernel"][0] * 1e6}
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
