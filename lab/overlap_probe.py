"""Can a memory-bound kernel hide under a compute-bound one on one GPU? `python -m lab.overlap_probe --out F`.

The physical bound of a mixed workload (bench/roofline.py) counts a step's compute and its memory
traffic as overlapped; our mixed steps run them one after the other (bench/NOTES.md, 2026-11-26: a
576-row step is the sum of its compute-bound matmuls and its memory-bound decode attention). This
probe measures, at Llama-3-8B's shapes, what running them at the same time on two CUDA streams gives:
a chain of `layers` gate/up matmuls of M prompt rows (cuBLAS) beside a chain of decode attentions
(kernels/paged_attention.py, 64 sequences of 512 tokens, each layer its own pages: cold L2), each
alone and both forked onto two streams inside one CUDA graph, optionally with cuBLAS told to leave
some SMs free (--carveouts), or with lab/tma_gemm.py's persistent matmul on fewer programs than
SMs (--triton-programs), the rest of the SMs left to the attention. Reports per layer: matmul alone,
attention alone, their sum, both together, and the share of the attention hidden
((sum - together) / attention). Writes one JSON with the GPU's name and the date.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from collections.abc import Callable

from lab.decode_splits import make_inputs
from lab.kernels import gpu_and_date, graph_us

HIDDEN, INTER = 4096, 14336
TMA_TILES = (128, 256, 64, 3, 8)  # one of lab/tma_gemm.py's candidates: 128 x 256 tiles, 3 stages, 8 warps
ATTN = dict(B=64, Hq=32, Hkv=8, D=128, bs=16, width=512, lo=512, hi=512)


def run(layers: int, rows: list[int], carveouts: list[int], programs: list[int]) -> dict:
    import torch

    from kernels.paged_attention import paged_decode_attention
    from lab.tma_gemm import matmul as tma_matmul

    attn = [make_inputs(**ATTN, seed=i) for i in range(layers)]
    attn_out = [torch.empty_like(a[0]) for a in attn]
    ws = [(torch.randn(2 * INTER, HIDDEN, device="cuda") / HIDDEN ** 0.5).bfloat16() for _ in range(layers)]
    side = torch.cuda.Stream()

    def attentions() -> None:
        for (q, kc, vc, bt, sl, ks, vs), o in zip(attn, attn_out):
            paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, out=o)

    out = gpu_and_date() | {"layers": layers, "attention": ATTN, "cases": []}
    attention_us = graph_us(attentions, per=layers)

    def measure(matmuls: Callable[[], None], m: int, **what) -> dict:
        """Per layer: the matmul chain alone, and beside the attention chain on a second stream."""

        def both() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                attentions()
            matmuls()
            torch.cuda.current_stream().wait_stream(side)

        mm_us = graph_us(matmuls, per=layers)
        both_us = graph_us(both, per=layers)
        row = {"rows": m, **what, "matmul_us": mm_us, "attention_us": attention_us, "sum_us": mm_us + attention_us,
               "together_us": both_us, "attention_hidden": (mm_us + attention_us - both_us) / attention_us,
               "matmul_tflops": 2 * m * HIDDEN * 2 * INTER / (mm_us * 1e-6) / 1e12}
        out["cases"].append(row)
        print(f"M={m:5d} {what}: matmul {mm_us:7.1f} us ({row['matmul_tflops']:.0f} TFLOP/s), attention "
              f"{attention_us:6.1f}, sum {row['sum_us']:7.1f}, together {both_us:7.1f}: "
              f"{row['attention_hidden']:.0%} of the attention hidden", flush=True)
        return row

    for m in rows:
        x = torch.randn(m, HIDDEN, device="cuda").bfloat16()
        y = torch.empty(m, 2 * INTER, device="cuda", dtype=torch.bfloat16)

        def cublas() -> None:
            for w in ws:
                torch.mm(x, w.t(), out=y)

        for carve in carveouts:  # SMs cuBLAS leaves to the other stream (torch's experimental knob)
            torch._C._set_sm_carveout_experimental(carve or None)
            try:
                measure(cublas, m, sm_carveout=carve)
            finally:
                torch._C._set_sm_carveout_experimental(None)
        for n in programs:  # our persistent TMA matmul on n programs: the other SMs free for the attention
            measure(lambda n=n: [tma_matmul(x, w, TMA_TILES, programs=n) for w in ws], m, triton_programs=n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", default="64,256,576,1024,2048", help="prompt rows of the matmuls")
    ap.add_argument("--carveouts", default="0", help="SMs the matmuls leave free (cuBLAS), each a run")
    ap.add_argument("--triton-programs", default="", help="also lab/tma_gemm.py's matmul on this many programs, each a run")
    args = ap.parse_args(argv)
    res = run(args.layers, [int(r) for r in args.rows.split(",")], [int(c) for c in args.carveouts.split(",")],
              [int(n) for n in args.triton_programs.split(",") if n])
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
