"""What a projection gains from pulling its weights into L2 while a latency-bound kernel before it
waits, on one GPU: `python -m lab.prefetch_probe --out F`.

Under tensor parallelism the fused cross-GPU sum (kernels/allreduce_norm.py) waits ~8 us on NVLink
with the memory idle, twice a layer. On two H100s (bench/NOTES.md, 2026-11-27) the gate/up kernel
after the first sum gained from prefetching its weights meanwhile (the TP=2 step 4.80 against 4.88
ms), while qkv after the second, on the skinny kernel with its weights prefetched, lost (5.21
against 4.90 ms with cuBLAS), by more than the skinny kernel's own deficit. This probe separates
the causes without a second GPU.

The sum's stand-in: 64 programs x 8 warps (its shape at 64 rows of 4,096) launched with PDL, which
let the next kernel start at once and spin --wait-us on the GPU's clock without touching memory.
After it, at Llama-3-8B's TP=2 shapes and 64 rows: qkv by cuBLAS, by cuBLAS after a separate kernel
that prefetches its weights (all, or the first half of every row), by the skinny kernel with its
prefetch (two tiles) and without PDL; gate/up by the fused kernel without and with its prefetch,
and after the separate prefetch kernel. Each in one CUDA graph over --layers layers' weights
(beyond L2), less the spin's own time; each output checked against cuBLAS. Writes one JSON with
the GPU's name and the date.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import triton
import triton.language as tl

from kernels.launch import cdiv, launch, next_pow2
from kernels.pdl import prefetch_l2, wait_for_prior

ROWS, HIDDEN = 64, 4096
QKV_N, INTER = 3072, 7168  # Llama-3-8B at TP=2: (32 + 2 x 8) x 128 / 2 columns of qkv, 14,336 / 2


@triton.jit
def _clock():
    """The GPU's global timer, ns (the asm's input is unused: an elementwise asm needs one)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_kernel(ns):
    """The sum's stand-in: the next kernel may launch at once; this one waits ns on the clock."""
    wait_for_prior(True)
    start = _clock()
    now = start
    while now - start < ns:
        now = _clock()


@triton.jit
def _prefetch_kernel(w_ptr, N, stride_wn, prefetch_k, BLOCK_N: tl.constexpr, LINES: tl.constexpr):
    """The first prefetch_k columns of BLOCK_N weight rows into L2, then the wait (so that it ends
    after the kernel before it, as every PDL kernel here does)."""
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    lines = tl.minimum(tl.arange(0, LINES) * 64, prefetch_k - 1)
    prefetch_l2(w_ptr + rows[:, None] * stride_wn + lines[None, :])
    wait_for_prior(True)


def spin(ns: int) -> None:
    launch(_spin_kernel, (64,), ns, num_warps=8, launch_pdl=True)


def prefetch(w, fraction: float = 1.0) -> None:
    """Pull the first `fraction` of every row of w [N, K] (16-bit) into L2, launched with PDL."""
    n, k = w.shape
    cols = max(64, int(k * fraction) // 64 * 64)
    launch(_prefetch_kernel, (cdiv(n, 32),), w, n, w.stride(0), cols, BLOCK_N=32, LINES=next_pow2(cols // 64),
           num_warps=4, launch_pdl=True)


def run(layers: int, wait_us: float) -> dict:
    import torch
    from torch.nn import functional as F

    from kernels import fused, gate_up as gu, linear
    from lab.kernels import gpu_and_date, graph_us

    ns = int(wait_us * 1e3)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, device="cuda", generator=g).bfloat16()
    qkv = [(torch.randn(QKV_N, HIDDEN, device="cuda", generator=g) / 64).bfloat16() for _ in range(layers)]
    gate_up = [(torch.randn(2 * INTER, HIDDEN, device="cuda", generator=g) / 64).bfloat16() for _ in range(layers)]
    spin_us = graph_us(lambda: [spin(ns) for _ in range(layers)], per=layers)
    out = gpu_and_date() | {"rows": ROWS, "layers": layers, "wait_us": wait_us, "spin_alone_us": spin_us,
                            "cases": []}
    print(f"{out['gpu']}: the spin alone {spin_us:.2f} us a layer", flush=True)

    def case(name: str, ws, proj, want_fn, before=None) -> None:
        got = proj(x, ws[0])
        want = want_fn(x, ws[0])
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()

        def chain(with_spin: bool) -> None:
            for w in ws:
                if with_spin:
                    spin(ns)
                if before is not None:
                    before(w)
                proj(x, w)

        after = graph_us(lambda: chain(True), per=layers)
        alone = graph_us(lambda: chain(False), per=layers)
        row = {"case": name, "after_spin_us": after - spin_us, "alone_us": alone, "rel_err": err}
        out["cases"].append(row)
        print(f"{name:58s} after the spin {after - spin_us:6.2f} us (alone {alone:6.2f}), err {err:.1e}", flush=True)

    plain = lambda x, w: F.linear(x, w)  # noqa: E731
    case("qkv cublas", qkv, plain, plain)
    case("qkv prefetch kernel (all) + cublas", qkv, plain, plain, before=prefetch)
    case("qkv prefetch kernel (first half) + cublas", qkv, plain, plain, before=lambda w: prefetch(w, 0.5))
    for tiles in (None, (32, 128, 2)):
        p = linear.plan(ROWS, QKV_N, HIDDEN) if tiles is None else linear.Plan(*tiles, swap=False)
        for pdl in (True, False):
            case(f"qkv skinny {p} pdl={pdl}", qkv, lambda x, w, p=p, pdl=pdl: linear.skinny_linear(x, w, p=p, pdl=pdl),
                 plain)
    silu = lambda x, w: fused.silu_and_mul(F.linear(x, w))  # noqa: E731
    case("gate_up fused", gate_up, lambda x, w: gu.gate_up_silu(x, w), silu)
    case("gate_up fused, its prefetch (the engine's at TP=2)", gate_up,
         lambda x, w: gu.gate_up_silu(x, w, prefetch=True), silu)
    case("gate_up prefetch kernel (24 MiB) + fused", gate_up, lambda x, w: gu.gate_up_silu(x, w), silu,
         before=lambda w: prefetch(w, (gu.PREFETCH_MAX_BYTES / w.element_size()) / w.numel()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8, help="weights cycled in the graph (beyond L2)")
    ap.add_argument("--wait-us", type=float, default=8.0, help="the stand-in sum's wait")
    args = ap.parse_args(argv)
    args.out.write_text(json.dumps(run(args.layers, args.wait_us), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
