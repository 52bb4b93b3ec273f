"""Do Triton compiles run in parallel on threads? Compiles N variants of a small matmul kernel one
after another, then N others on N threads (`kernel.warmup`, each variant new to a fresh cache).

    python -m lab.compile_threads [--variants 8]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.compile_threads")
    p.add_argument("--variants", type=int, default=8)
    args = p.parse_args(argv)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def mm(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SALT: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x = tl.load(a + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            y = tl.load(b + (k + rk)[:, None] * N + rn[None, :], mask=rn[None, :] < N, other=0.0)
            acc = tl.dot(x, y, acc)
        acc = acc * (SALT + 1)
        tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))

    t = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")

    def compile_one(salt: int) -> None:
        mm.warmup(t, t, t, 64, 64, 64, BM=64, BN=64, BK=32, SALT=salt, grid=(1, 1))

    compile_one(-1)  # imports, driver set-up
    t0 = time.perf_counter()
    for s in range(args.variants):
        compile_one(s)
    serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.variants) as pool:
        list(pool.map(compile_one, range(args.variants, 2 * args.variants)))
    threaded = time.perf_counter() - t0
    print(json.dumps({"triton": triton.__version__, "variants": args.variants, "serial_s": serial,
                      "threads_s": threaded, "speedup": serial / threaded}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
