"""Quantized-page decode attention: split count x pipeline stages x register cap on the GPU:
`python -m lab.decode_occupancy [--out DIR]`.

The fp8/int8 decode kernel needs ~168 registers and, at three stages, 76 KB of shared memory per
program: two or three programs per SM, so Llama-3-8B at batch 64 (512 programs) ran in a ragged
second wave. This times every combination of splits (1-32), num_stages (2, 3) and maxnreg (none,
128) at several shapes (Triton's do_bench, L2 flushed, median), next to the bf16 default at the
same shape. It is the evidence for kernels/paged_attention.py decode_config's quantized choice.
Writes decode-occupancy-<gpu>.json.
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from lab.kernels import RESULTS, gpu_and_date, slug, write_json

LLAMA = dict(Hq=32, Hkv=8, D=128)
QWEN = dict(Hq=14, Hkv=2, D=64)
CASES = [
    ("llama B64 4096 bs16", dict(B=64, ctx=4096, bs=16, **LLAMA), ("fp8", "int8")),
    # the same pages in order, not scattered: does block size 16 lose to 32 by the DRAM pattern?
    ("llama B64 4096 bs16 contiguous", dict(B=64, ctx=4096, bs=16, contiguous=True, **LLAMA), ("fp8",)),
    # V's scales read from K's (the same addresses): what the second scale load costs at all
    ("llama B64 4096 bs16 one scale stream", dict(B=64, ctx=4096, bs=16, same_scales=True, **LLAMA), ("fp8",)),
    ("llama B64 4096 bs32", dict(B=64, ctx=4096, bs=32, **LLAMA), ("fp8",)),
    ("llama B256 1024 bs16", dict(B=256, ctx=1024, bs=16, **LLAMA), ("fp8",)),
    ("llama B8 4096 bs16", dict(B=8, ctx=4096, bs=16, **LLAMA), ("fp8",)),
    ("llama B1 32768 bs16", dict(B=1, ctx=32768, bs=16, **LLAMA), ("fp8",)),
    ("llama B64 512 bs16", dict(B=64, ctx=512, bs=16, **LLAMA), ("fp8",)),
    ("qwen B64 4096 bs16", dict(B=64, ctx=4096, bs=16, **QWEN), ("fp8",)),
    ("qwen B64 512 bs16", dict(B=64, ctx=512, bs=16, **QWEN), ("fp8",)),
]
CONFIGS = [dict(num_splits=s, num_stages=st, maxnreg=r)
           for s, st, r in itertools.product((1, 2, 3, 4, 8, 16, 32), (2, 3), (None, 128))]
PARTS = 3  # compile jobs per (case, page dtype)


def _inputs(c: dict, kv: str | None):
    """Timing inputs; the diagnostic cases (contiguous pages, one scale stream) time the same kernel
    on other data, so their outputs are not meaningful."""
    from lab.kernels import decode_inputs
    q, kc, vc, ks, vs, bt, sl = decode_inputs(c["B"], c["ctx"], c["Hq"], c["Hkv"], c["D"], c["bs"], kv,
                                              contiguous=c.get("contiguous", False))
    if c.get("same_scales") and ks is not None:
        vs = ks
    return q, kc, vc, ks, vs, bt, sl


def _compile(job: tuple) -> int:
    """Worker process: compile a share of one case's configurations into Triton's disk cache."""
    import torch

    from kernels.paged_attention import paged_decode_attention
    case, kv, part = job
    q, kc, vc, ks, vs, bt, sl = _inputs(CASES[case][1], kv)
    errors = 0
    for cfg in ([None] + CONFIGS)[part::PARTS]:
        try:
            paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, config=cfg)
        except Exception:  # out of resources: left out of the timing pass too
            errors += 1
    torch.cuda.synchronize()
    return errors


def main(argv: list[str] | None = None) -> int:
    import concurrent.futures as cf
    import multiprocessing as mp

    import torch

    from lab.kernels import bench, copy_bandwidth, decode_bytes
    from kernels.paged_attention import decode_config, paged_decode_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--workers", type=int, default=12, help="processes compiling configurations")
    args = ap.parse_args(argv)
    t0 = time.time()
    jobs = [(i, kv, p) for i, (_, _, kvs) in enumerate(CASES) for kv in kvs for p in range(PARTS)]
    with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
        errors = sum(ex.map(_compile, jobs))
    print(f"compiled in {time.time() - t0:.0f}s ({errors} configurations failed)", flush=True)
    copy_bw = copy_bandwidth()
    rows = []
    for name, c, kvs in CASES:
        q, kc, vc, ks, vs, bt, sl = _inputs(c, None)
        out = torch.empty_like(q)
        bf16_s = bench(lambda: paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, out=out))
        for kv in kvs:
            q, kc, vc, ks, vs, bt, sl = _inputs(c, kv)
            out = torch.empty_like(q)
            nbytes = decode_bytes(c["B"], c["ctx"], c["Hq"], c["Hkv"], c["D"], c["bs"], kv)
            default = decode_config(c["B"], c["Hkv"], bt.shape[1] * c["bs"], c["D"], False, True)
            timed = []
            for cfg in [None] + CONFIGS:
                fn = lambda cfg=cfg: paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, out=out, config=cfg)  # noqa: E731
                try:
                    fn()
                    t = bench(fn, warmup=10, rep=60)
                except Exception:
                    continue
                timed.append(dict(case=name, kv=kv, config=cfg or {"default": default}, time_us=t * 1e6,
                                  bf16_us=bf16_s * 1e6, speedup_vs_bf16=bf16_s / t, frac_copy_bw=nbytes / t / copy_bw))
            rows += timed
            best = min(timed[1:], key=lambda r: r["time_us"])
            print(f"{name} {kv}: bf16 {bf16_s * 1e6:.1f} us, default {timed[0]['time_us']:.1f} us "
                  f"(x{timed[0]['speedup_vs_bf16']:.2f}), best {best['time_us']:.1f} us {best['config']}", flush=True)
        del q, kc, vc, ks, vs, bt, sl, out
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-occupancy-{slug(gpu)}.json"
    write_json(path, gpu_and_date() | dict(copy_bw_GBps=copy_bw / 1e9, rows=rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
