"""A mixed step's attention for small models, alone and as the whole-step graph launches it.

    python -m lab.mixed_attention [--layered] --out mixed-attention.json

Qwen2.5-0.5B's heads (14/2, 64): one to four prompt chunks of 256-1,024 tokens packed after 56
decode rows in a step of T rows whose graph plans for R = 64 decodes (engine/step_graph.py's layout:
chunk j is sequence entry R + j, its query starts are rows of q, the work list is planned for
max_query_len = T). Timed in CUDA graphs (8 calls a replay, the same inputs): prefill attention of
the chunks on their own q (lab/prefill_short.py's case) against the work-list form inside the
step's q, for the Hopper kernel and the Triton one; decode attention over R rows of --context tokens
with a block table as wide as the step graphs' and as wide as the contexts need. --layered: one
512-token chunk in 24 layers of its own inputs, alone, after an L2-evicting copy and after decode
attention. On an H100 (2026-11-28, bench/NOTES.md) the Hopper kernel took 11.8-13.2 us a layer
in these settings and 19.1 in the engine's own steps, the Triton kernel 8.7-10.2 and 9.1.
"""
from __future__ import annotations

import argparse
import json
import sys

HQ, HKV, D, BS = 14, 2, 64, 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.mixed_attention", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=32768, help="sets the step graphs' block-table width")
    p.add_argument("--layered", action="store_true",
                   help="also: the step form of one 512-token chunk in 24 layers, alone, after a copy that evicts L2 "
                        "and after decode attention, kernel times by torch.profiler")
    a = p.parse_args(argv)
    import torch

    from kernels.paged_attention import paged_decode_attention
    from kernels.prefill_attention import paged_prefill_attention, prefill_plan, work_list
    from lab.kernels import decode_inputs, gpu_and_date, graph_us, prefill_call, prefill_inputs, write_json

    R, scale = 64, D ** -0.5
    rows: list[dict] = []
    for chunks, chunk in ((1, 512), (2, 512), (4, 512), (1, 256), (1, 1024)):
        x = prefill_inputs(chunks, chunk, 0, HQ, HKV, D, BS)
        T = -(-(R + chunks * chunk) // 64) * 64
        S = R + 16
        g = torch.Generator(device="cuda").manual_seed(3)
        qkv = torch.randn((T, (HQ + 2 * HKV) * D), device="cuda", generator=g, dtype=torch.bfloat16)
        first = R - 8  # the decodes' rows: R - 8 of them, as in a step whose decode count rounds up to R
        n = chunks * chunk
        qkv[first:first + n] = torch.cat([x["q"].reshape(n, -1), x["k"].reshape(n, -1), x["v"].reshape(n, -1)], 1)
        q = qkv[:, :HQ * D].view(T, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(T, HKV, D)
        width = a.max_model_len // BS
        bt = torch.zeros((S, width), dtype=torch.int32, device="cuda")
        bt[R:R + chunks, :x["bt"].shape[1]] = x["bt"]
        sl = torch.ones(S, dtype=torch.int32, device="cuda")
        sl[R:R + chunks] = chunk
        qs = torch.full((S + 1,), first + n, dtype=torch.int32, device="cuda")
        qs[R:R + chunks + 1] = torch.arange(first, first + n + 1, chunk, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        row: dict = {"chunks": chunks, "tokens": chunk, "step_rows": T}
        ref = prefill_call(x, chunk, D)
        for name, cfg in (("hopper", {"ws": True}), ("triton", {"ws": False})):
            plan = prefill_plan(q, x["kc"], T, cfg, k, v)
            work = torch.from_numpy(work_list(list(range(R, R + chunks)), [chunk] * chunks, plan["tok_m"],
                                              -(-T // plan["tok_m"]) + 16)).cuda()

            def step_form(cfg=cfg, work=work):
                return paged_prefill_attention(q, x["kc"], x["vc"], bt, sl, qs, scale, x["ks"], x["vs"], T, cfg,
                                               k=k, v=v, out=out, work=work)
            got = step_form()[first:first + n]
            row[f"{name}_max_diff"] = float((got.float() - ref.float()).abs().max())
            row[f"{name}_alone_us"] = round(graph_us(lambda cfg=cfg: [prefill_call(x, chunk, D, cfg)
                                                                     for _ in range(8)], per=8), 2)
            row[f"{name}_step_form_us"] = round(graph_us(lambda f=step_form: [f() for _ in range(8)], per=8), 2)
            row[f"{name}_work_items"] = int(work.numel())
        rows.append(row)
        print(json.dumps(row), flush=True)
    dq, kc, vc, ks, vs, dbt, dsl = decode_inputs(R, a.context, HQ, HKV, D, BS, None)
    wide = torch.zeros((R, a.max_model_len // BS), dtype=torch.int32, device="cuda")
    wide[:, :dbt.shape[1]] = dbt
    dec = {"context": a.context, "rows": R}
    for name, table in (("narrow", dbt), ("wide", wide)):
        dec[f"{name}_us"] = round(graph_us(lambda t=table: [paged_decode_attention(dq, kc, vc, t, dsl, scale)
                                                            for _ in range(8)], per=8), 2)
    print(json.dumps(dec), flush=True)
    result = gpu_and_date() | {"heads": [HQ, HKV, D], "prefill": rows, "decode": dec}
    if a.layered:
        result["layered"] = layered(a.max_model_len)
        print(json.dumps(result["layered"]), flush=True)
    write_json(a.out, result)
    return 0


def layered(max_model_len: int, layers: int = 24, chunk: int = 512) -> dict:
    """Each layer's own q/k/v and pages, the prefill attention alone, after a copy of 64 MB (the
    weights a layer streams and more: neither the data nor the kernel's code stays in L2), or after
    decode attention over 64 sequences' own pages (a mixed step's order)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kernels.paged_attention import paged_decode_attention
    from kernels.prefill_attention import paged_prefill_attention, prefill_plan, work_list
    from lab.kernels import decode_inputs, prefill_inputs

    R, scale = 64, D ** -0.5
    T = -(-(R + chunk) // 64) * 64
    first = R - 8
    xs = [prefill_inputs(1, chunk, 0, HQ, HKV, D, BS, seed=i) for i in range(layers)]
    S = R + 16
    bt = torch.zeros((S, max_model_len // BS), dtype=torch.int32, device="cuda")
    bt[R, :xs[0]["bt"].shape[1]] = xs[0]["bt"][0]
    sl = torch.ones(S, dtype=torch.int32, device="cuda")
    sl[R] = chunk
    qs = torch.full((S + 1,), first + chunk, dtype=torch.int32, device="cuda")
    qs[R] = first
    qkvs = []
    for x in xs:
        qkv = torch.zeros((T, (HQ + 2 * HKV) * D), device="cuda", dtype=torch.bfloat16)
        qkv[first:first + chunk] = torch.cat([x["q"].reshape(chunk, -1), x["k"].reshape(chunk, -1),
                                              x["v"].reshape(chunk, -1)], 1)
        qkvs.append(qkv)
    src = torch.empty(32 << 20, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    # each layer's decode rows: R sequences of 512 tokens over their own pages
    decs = [decode_inputs(R, 512, HQ, HKV, D, BS, None, seed=100 + i) for i in range(layers)]
    dec_out = torch.empty_like(decs[0][0])
    out = torch.empty((T, HQ, D), dtype=torch.bfloat16, device="cuda")
    res: dict = {"layers": layers, "chunk": chunk, "step_rows": T}
    for name, cfg in (("hopper", {"ws": True}), ("triton", {"ws": False})):
        for before in ("", "flushed", "decode"):
            def views(qkv):
                return (qkv[:, :HQ * D].view(T, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D),
                        qkv[:, (HQ + HKV) * D:].view(T, HKV, D))
            q0, k0, v0 = views(qkvs[0])
            plan = prefill_plan(q0, xs[0]["kc"], T, cfg, k0, v0)
            work = torch.from_numpy(work_list([R], [chunk], plan["tok_m"], -(-T // plan["tok_m"]) + 16)).cuda()

            def step(cfg=cfg, work=work, before=before):
                for x, qkv, dec in zip(xs, qkvs, decs):
                    if before == "flushed":
                        dst.copy_(src)
                    elif before == "decode":  # as in a mixed step: decode attention over cold pages first
                        paged_decode_attention(dec[0], dec[1], dec[2], dec[5], dec[6], scale, out=dec_out)
                    q, k, v = views(qkv)
                    paged_prefill_attention(q, x["kc"], x["vc"], bt, sl, qs, scale, x["ks"], x["vs"], T, cfg,
                                            k=k, v=v, out=out, work=work)
            step()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    g.replay()
                torch.cuda.synchronize()
            for kind in ("prefill", "decode"):
                kern = [e for e in prof.key_averages() if f"_{kind}" in e.key]
                if kern:
                    us = sum(e.device_time_total for e in kern) / sum(e.count for e in kern)
                    res[f"{name}_{kind}{'_after_' + before if before else ''}_us"] = round(us, 2)
    return res


if __name__ == "__main__":
    sys.exit(main())
