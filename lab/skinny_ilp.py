"""The skinny decode matmul with its K loop split into independent accumulator chains.

    python -m lab.skinny_ilp [--json OUT]

ncu on the engine's decode matmuls with their weights in L2 (bench/NOTES.md, 2026-11-27, night):
L2 busy 11-35%, L1 36-44%, SMs 6-14%, one warp a scheduler issuing an instruction every 3.7-5.7
cycles: each program waits on its own chain of products along K (K / 16 tensor-core steps into
one accumulator), not on bytes. Here each iteration takes CHAINS K tiles into CHAINS accumulators,
summed at the end, so that the products of different tiles can overlap. Same tiles, splits and
stages as kernels/linear.py's plan otherwise; timed against it in CUDA graphs, cold and with the
weights in L2, at Qwen2.5-0.5B's and Llama-3-8B's decode shapes.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import triton
import triton.language as tl

from kernels import linear as lin
from kernels.attn_common import mma
from kernels.launch import launch, next_pow2
from lab.kernels import gpu_and_date, write_json


@triton.jit
def _tile(x_ptr, w_ptr, offs_m, offs_n, offs_k, k, k_hi, m_mask, n_mask, stride_xm, stride_wn, NATIVE: tl.constexpr):
    ok = (k + offs_k < k_hi)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=m_mask[:, None] & ok, other=0.0)
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k + offs_k)[None, :],
                mask=n_mask[:, None] & ok, other=0.0)
    return mma(x, tl.trans(w), NATIVE)


@triton.jit(do_not_specialize=["M"])
def _ilp_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, split,
                stride_xm, stride_wn, stride_om,
                HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr, SPLIT_ONE: tl.constexpr, CHAINS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K * CHAINS):
        acc0 += _tile(x_ptr, w_ptr, offs_m, offs_n, offs_k, k, k_hi, m_mask, n_mask, stride_xm, stride_wn, NATIVE)
        if CHAINS >= 2:
            acc1 += _tile(x_ptr, w_ptr, offs_m, offs_n, offs_k, k + BLOCK_K, k_hi, m_mask, n_mask,
                          stride_xm, stride_wn, NATIVE)
        if CHAINS >= 4:
            acc2 += _tile(x_ptr, w_ptr, offs_m, offs_n, offs_k, k + 2 * BLOCK_K, k_hi, m_mask, n_mask,
                          stride_xm, stride_wn, NATIVE)
            acc3 += _tile(x_ptr, w_ptr, offs_m, offs_n, offs_k, k + 3 * BLOCK_K, k_hi, m_mask, n_mask,
                          stride_xm, stride_wn, NATIVE)
    acc = (acc0 + acc1) + (acc2 + acc3)
    lin._finish(acc, b_ptr, out_ptr, part_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n, M, N, split, stride_om,
                HAS_BIAS, SPLIT_ONE)


def ilp_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, p: lin.Plan, chains: int) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles, k_per_split, split, part, counters = lin.k_split(out, K, p)
    launch(_ilp_kernel, (tiles, split),
           x, w, bias if bias is not None else w, out, part, counters, M, N, K, k_per_split, split,
           x.stride(0), w.stride(0), out.stride(0),
           HAS_BIAS=bias is not None, NATIVE=x.is_cuda, SPLIT_ONE=split == 1, CHAINS=chains,
           BLOCK_M=max(16, next_pow2(M)), BLOCK_N=p.block_n, BLOCK_K=p.block_k,
           num_warps=p.num_warps, num_stages=p.num_stages)
    return out


SHAPES = [("qwen2.5-0.5b qkv", 1152, 896, True), ("qwen2.5-0.5b o", 896, 896, False),
          ("qwen2.5-0.5b down", 896, 4864, False), ("smollm2-135m down", 576, 1536, False),
          ("llama3-8b down", 4096, 14336, False)]


def main(argv: list[str] | None = None) -> int:
    from lab.kernels import cold_copies, graph_time

    p = argparse.ArgumentParser(prog="python -m lab.skinny_ilp", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lab.skinny_ilp: needs a CUDA GPU", file=sys.stderr)
        return 1
    bf = torch.bfloat16
    rows = []
    for name, N, K, has_bias in SHAPES:
        copies = cold_copies(N * K * 2)
        ws = [torch.randn(N, K, device="cuda", dtype=bf) * 0.05 for _ in range(copies)]
        bs = [torch.randn(N, device="cuda", dtype=bf) if has_bias else None for _ in range(copies)]
        for M in (16, 64):
            x = torch.randn(M, K, device="cuda", dtype=bf)
            base = lin.supports(x, ws[0])
            if base is None:
                continue
            ref = lin.skinny_linear(x, ws[0], bs[0], p=base).float()
            res = {}
            for hot in (False, True):
                wi = (lambda i: 0) if hot else (lambda i: i)
                res[("engine", hot)] = graph_time(lambda i: lin.skinny_linear(x, ws[wi(i)], bs[wi(i)], p=base), copies)
                tile_bytes = (max(16, next_pow2(M)) + base.block_n) * base.block_k * 2
                for chains, stages in ((1, base.num_stages), (1, 2), (2, 2), (2, base.num_stages), (4, 2),
                                       (1, 6), (1, 8)):
                    if chains * stages * tile_bytes > 200 << 10:  # shared memory: stages x chains tiles
                        continue
                    pl = dataclasses.replace(base, num_stages=stages)
                    try:
                        res[(f"chains {chains} stages {stages}", hot)] = graph_time(
                            lambda i: ilp_linear(x, ws[wi(i)], bs[wi(i)], pl, chains), copies)
                    except triton.runtime.errors.OutOfResources:
                        torch.cuda.synchronize()
            one = dataclasses.replace(base, num_stages=1)  # a check of the sums, not timed: no buffers to fit
            errs = {c: (ilp_linear(x, ws[0], bs[0], one, c).float() - ref).abs().max().item() for c in (1, 2, 4)}
            line = {k: v * 1e6 for k, v in res.items()}
            print(f"{name} M={M} ({base.block_n} cols, split {base.split}): " + ", ".join(
                f"{k[0]}{' hot' if k[1] else ''} {v:.2f}" for k, v in line.items()) + f"; max diff {errs}", flush=True)
            rows.append({"shape": name, "M": M, "N": N, "K": K, "plan": str(base), "max_diff": errs,
                         "us": [{"variant": k[0], "hot_l2": k[1], "us": v} for k, v in line.items()]})
    write_json(a.json, gpu_and_date() | {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
