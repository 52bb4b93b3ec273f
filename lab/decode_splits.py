"""Decode attention split planning sweep on the GPU: `python -m lab.decode_splits [--kv fp8] [--cold] [--out DIR]`.

Times paged_decode_attention (CUDA-graph replays, triton.testing.do_bench_cudagraph) at the
default launch plan and at other split counts, minimum tiles per split, tile sizes and block-table
prefetch, for Llama-3-8B and Qwen2.5-0.5B heads at serving-like contexts (random lengths in a
range, block tables as wide as the model's context). It is the evidence for
kernels/paged_attention.py's TARGET_PROGRAMS. Writes decode-splits-<kv>-<gpu>.json.

One layer's pages (up to ~20 MB at these shapes) stay in the H100's 50 MB L2 between replays,
which a decode step never sees: each layer's pages are read once a step. --cold times instead
several layers' caches (~600 MB together) attended in turn inside one graph, per layer, for a few
plan candidates (the block-table prefetch on and off, one split of 128-token tiles); it is the
evidence for decode_config's prefetch rule. Writes decode-cold-<kv>-<gpu>.json.
"""
from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path

from lab.kernels import RESULTS, gpu_and_date, graph_us, slug, write_json

CASES = {
    "qwen B64 512-640 w2048": dict(B=64, Hq=14, Hkv=2, D=64, bs=16, width=2048, lo=512, hi=640),
    "llama B64 512-640 w512": dict(B=64, Hq=32, Hkv=8, D=128, bs=16, width=512, lo=512, hi=640),
    "qwen B64 4096 w2048": dict(B=64, Hq=14, Hkv=2, D=64, bs=16, width=2048, lo=4096, hi=4096),
    "llama B64 4096 w512": dict(B=64, Hq=32, Hkv=8, D=128, bs=16, width=512, lo=4096, hi=4096),
    "llama B8 4096 w512": dict(B=8, Hq=32, Hkv=8, D=128, bs=16, width=512, lo=4096, hi=4096),
    "llama B1 32768 w2048": dict(B=1, Hq=32, Hkv=8, D=128, bs=16, width=2048, lo=32768, hi=32768),
    "qwen B16 100-700 w2048": dict(B=16, Hq=14, Hkv=2, D=64, bs=16, width=2048, lo=100, hi=700),
    "qwen B256 512-640 w2048": dict(B=256, Hq=14, Hkv=2, D=64, bs=16, width=2048, lo=512, hi=640),
}
# Llama-3-8B's heads per rank at TP = 1, 2, 4: one decode step of pp_check's 64 x 512 tokens
TP_CASES = {f"llama TP={tp} B64 512 w512": dict(B=64, Hq=32 // tp, Hkv=8 // tp, D=128, bs=16, width=512, lo=512, hi=512)
            for tp in (1, 2, 4)}
FULL_GRID = {"qwen B64 512-640 w2048", "llama B64 512-640 w512"}  # every tile / split / min-tiles / prefetch
FP8_CASES = ("llama B64 4096 w512", "llama B64 512-640 w512", "qwen B64 512-640 w2048", "llama B8 4096 w512")


def make_inputs(B, Hq, Hkv, D, bs, width, lo, hi, kv=None, seed=0):
    """q, caches, block tables (rows of `width` entries, random distinct pages) and seq_lens drawn
    in [lo, hi]."""
    import torch

    from kvcache import quant

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (B,), generator=g).to(torch.int32)
    need = [(int(n) + bs - 1) // bs for n in lens]
    nb = sum(need) + 1
    dt = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    kc = torch.randn(nb, Hkv, bs, D, device="cuda").to(dt)
    vc = torch.randn(quant.v_page_shape((nb, Hkv, bs, D), kv is not None), device="cuda").to(dt)
    ks = vs = None
    if kv:  # the pool's layout: K's and V's scales of a page side by side (kvcache/quant.py)
        ks, vs = quant.scale_views(quant.new_scales(nb, Hkv, bs, "cuda").uniform_())
    perm = torch.randperm(nb - 1, generator=g) + 1
    bt = torch.zeros(B, width, dtype=torch.int32)
    o = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[o:o + n]
        o += n
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, bt.cuda(), lens.cuda(), ks, vs


def time_us(inputs, cfg: dict) -> float:
    import torch

    from kernels.paged_attention import paged_decode_attention

    q, kc, vc, bt, sl, ks, vs = inputs
    out = torch.empty_like(q)
    return graph_us(lambda: paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, out=out, config=cfg), rep=100)


def sweep(kv: str | None) -> list[dict]:
    import torch

    from kernels.paged_attention import decode_config

    rows = []
    for name in (FP8_CASES if kv else CASES):
        c = CASES[name]
        inputs = make_inputs(**c, kv=kv)
        default = decode_config(c["B"], c["Hkv"], c["width"] * c["bs"], c["D"], False, kv is not None)
        base = time_us(inputs, {})
        rows.append(dict(case=name, cfg="default", us=base, default=default))
        if kv:
            grid = [(None, s, None, None) for s in (1, 2, 4, 8, 16)]
        elif name in FULL_GRID:
            grid = itertools.product((32, 64), (1, 2, 4, 8, 16), (2, 4, 8, 16), (False, True))
        else:
            grid = [(64, s, m, False) for s in (1, 2, 4, 8, 16, 32) for m in (2, 4, 8)]
        best = (base, "default")
        for tile, splits, min_tiles, prefetch in grid:
            cfg = {k: v for k, v in dict(tile_n=tile, num_splits=splits, min_tiles=min_tiles,
                                         prefetch=prefetch).items() if v is not None}
            t = time_us(inputs, cfg)
            rows.append(dict(case=name, cfg=cfg, us=t))
            best = min(best, (t, cfg), key=lambda x: x[0])
        print(name, "default", default["num_splits"], f"{base:.1f} us; best {best[0]:.1f} us", best[1], flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


COLD_CASES = ("qwen B64 512-640 w2048", "qwen B16 100-700 w2048", "qwen B256 512-640 w2048", "qwen B64 4096 w2048",
              "llama B64 512-640 w512", "llama B8 4096 w512", "llama B64 4096 w512")


def cold_layers(c: dict, kv: str | None, max_layers: int) -> tuple[int, float, Callable[[dict], None]]:
    """Case c's inputs for as many layers as ~600 MB of pages take (2 to max_layers: beyond L2) ->
    (layers, one layer's page bytes, run(config): the attention over every layer in turn)."""
    import torch

    from kernels.paged_attention import paged_decode_attention

    layer_bytes = c["B"] * (c["lo"] + c["hi"]) / 2 * c["Hkv"] * c["D"] * 2 * (1 if kv else 2)
    n = int(max(2, min(max_layers, 600e6 // layer_bytes)))
    layers = [make_inputs(**c, kv=kv, seed=i) for i in range(n)]
    outs = [torch.empty_like(x[0]) for x in layers]

    def run(cfg: dict) -> None:
        for (q, kc, vc, bt, sl, ks, vs), o in zip(layers, outs):
            paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, out=o, config=cfg)
    return n, layer_bytes, run


def cold_sweep(kv: str | None) -> list[dict]:
    import torch

    from kernels.paged_attention import decode_config

    rows = []
    for name in COLD_CASES:
        c = CASES[name]
        n, layer_bytes, run = cold_layers(c, kv, 24)
        default = decode_config(c["B"], c["Hkv"], c["width"] * c["bs"], c["D"], False, kv is not None)
        cands = {"default": {}, "prefetch": {"prefetch": True}, "no prefetch": {"prefetch": False},
                 "1 split, 128-token tiles, prefetch": {"num_splits": 1, "tile_n": 128, "min_tiles": 1, "prefetch": True}}
        times = {k: graph_us(lambda: run(v), per=n) for k, v in cands.items()}
        rows.append(dict(case=name, layers=n, layer_mb=layer_bytes / 1e6, default=default, us_per_layer=times))
        print(f"{name} ({n} layers, default splits {default['num_splits']}, prefetch {default['prefetch']}): " +
              ", ".join(f"{k} {v:.2f} us" for k, v in times.items()), flush=True)
        del run
        torch.cuda.empty_cache()
    return rows


def tp_sweep() -> list[dict]:
    """Cold L2 (many layers' caches in turn, per layer) at Llama-3-8B's heads per tensor-parallel
    rank: the default plan against split counts, tile sizes and the block-table prefetch."""
    import torch

    from kernels.paged_attention import decode_config

    rows = []
    for name, c in TP_CASES.items():
        n, layer_bytes, run = cold_layers(c, None, 32)
        default = decode_config(c["B"], c["Hkv"], c["width"] * c["bs"], c["D"], False)
        cands = {"default": {}} | {f"splits {s} tile {t} prefetch {p}": {"num_splits": s, "tile_n": t, "prefetch": p}
                                   for s in (1, 2, 3, 4) for t in (32, 64) for p in (False, True)}
        times = {k: graph_us(lambda: run(v), per=n) for k, v in cands.items()}
        best = min(times, key=times.get)
        rows.append(dict(case=name, layers=n, layer_mb=layer_bytes / 1e6, default=default, us_per_layer=times,
                         best=best))
        print(f"{name} ({n} layers of {layer_bytes / 1e6:.0f} MB, default splits {default['num_splits']}, prefetch "
              f"{default['prefetch']}): default {times['default']:.2f} us, best {best} {times[best]:.2f} us", flush=True)
        del run
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", choices=["bf16", "fp8"], default="bf16", help="page dtype")
    ap.add_argument("--cold", action="store_true", help="per layer over many layers' caches (cold L2)")
    ap.add_argument("--tp", action="store_true", help="cold, at Llama-3-8B's heads per rank for TP = 1, 2, 4")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    kv = None if args.kv == "bf16" else "fp8"
    rows = tp_sweep() if args.tp else cold_sweep(kv) if args.cold else sweep(kv)
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "tp" if args.tp else "cold" if args.cold else "splits"
    path = args.out / f"decode-{mode}-{args.kv}-{slug(gpu)}.json"
    write_json(path, gpu_and_date() | dict(kv=args.kv, results=rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
