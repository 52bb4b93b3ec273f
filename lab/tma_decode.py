"""Decode attention with each KV page loaded by TMA, one program per (sequence, KV head), against
the engine's kernel (kernels/paged_attention.py), for 64-wide heads at about one pair an SM.

    python -m lab.tma_decode [--json OUT]

lab/stream_floor.py found one program an SM of 4 warps streaming 18.9 MB (Qwen2.5-0.5B's KV at 64
sequences x 576 tokens) in ~9.0 us with TMA tiles pipelined 5 deep, where plain loads in the same
grid took 18-19 us and the engine's attention (one 8-warp program a pair, plain loads through the
block table) 11.8 us. Here each page [block_size, head_dim] of K and V is one TMA box of a 2-D
view of the cache, PAGES pages an iteration (one online-softmax update each), the block-table
entries loaded by the pipeliner ahead of them. bf16 pages, no splits, no rotary: the question is
only whether the engine's fat program would read its pages faster this way.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
import triton
import triton.language as tl

from kernels.attn_common import LOG2E, mma
from kernels.launch import TensorDescriptor, next_pow2
from lab.kernels import gpu_and_date, write_json


@triton.jit
def _update(q, k, v, pos, seq_len, m_i, l_i, acc, qk_scale, NATIVE: tl.constexpr):
    s = mma(q, k.T, NATIVE) * qk_scale
    s = tl.where((pos < seq_len)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, NATIVE)
    return m_new, l_i, acc


@triton.jit
def _tma_decode_kernel(q_ptr, k_desc, v_desc, bt_ptr, sl_ptr, out_ptr, qk_scale,
                       stride_qb, stride_qh, stride_ob, stride_oh, stride_btb,
                       HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BS: tl.constexpr, PAGES: tl.constexpr, STAGES: tl.constexpr, NATIVE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(sl_ptr + b)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    n_pages = tl.cdiv(seq_len, BS)
    j = tl.arange(0, BS)
    for i in tl.range(0, n_pages, PAGES, num_stages=STAGES):
        blk0 = tl.load(bt_row + i)
        r0 = (blk0 * HKV + kvh) * BS
        k0 = k_desc.load([r0, 0])
        v0 = v_desc.load([r0, 0])
        if PAGES == 2:
            blk1 = tl.load(bt_row + i + 1, mask=i + 1 < n_pages, other=0)
            r1 = (blk1 * HKV + kvh) * BS
            k1 = k_desc.load([r1, 0])
            v1 = v_desc.load([r1, 0])
        m_i, l_i, acc = _update(q, k0, v0, i * BS + j, seq_len, m_i, l_i, acc, qk_scale, NATIVE)
        if PAGES == 2:
            m_i, l_i, acc = _update(q, k1, v1, (i + 1) * BS + j, seq_len, m_i, l_i, acc, qk_scale, NATIVE)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def tma_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, pages=1, stages=4, num_warps=4, descs=None):
    """q [B, Hq, D], caches [nb, Hkv, bs, D] (bf16) -> [B, Hq, D]."""
    B, Hq, D = q.shape
    nb, Hkv, bs, _ = k_cache.shape
    if descs is None:
        descs = tma_descs(k_cache, v_cache)
    out = torch.empty_like(q)
    group = Hq // Hkv
    _tma_decode_kernel[(B, Hkv)](q, descs[0], descs[1], block_tables, seq_lens, out, scale * LOG2E,
                                 q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
                                 HKV=Hkv, GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=D,
                                 BS=bs, PAGES=pages, STAGES=stages, NATIVE=q.is_cuda, num_warps=num_warps)
    return out


def tma_descs(k_cache, v_cache):
    nb, Hkv, bs, D = k_cache.shape
    return tuple(TensorDescriptor(c.view(nb * Hkv * bs, D), [nb * Hkv * bs, D], [D, 1], [bs, D])
                 for c in (k_cache, v_cache))


def main(argv: list[str] | None = None) -> int:
    from kernels.paged_attention import paged_decode_attention
    from lab.kernels import decode_inputs, graph_time

    p = argparse.ArgumentParser(prog="python -m lab.tma_decode", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("lab.tma_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    cases = [dict(B=64, ctx=576, Hq=14, Hkv=2, D=64, bs=16), dict(B=64, ctx=2048, Hq=14, Hkv=2, D=64, bs=16),
             dict(B=64, ctx=576, Hq=9, Hkv=3, D=64, bs=16)]
    rows = []
    for c in cases:
        copies = 24
        ins = [decode_inputs(c["B"], c["ctx"], c["Hq"], c["Hkv"], c["D"], c["bs"], None, seed=i) for i in range(copies)]
        # ragged lengths: each sequence between half and all of ctx
        for i, x in enumerate(ins):
            g = torch.Generator(device="cuda").manual_seed(100 + i)
            x[6].copy_(torch.randint(c["ctx"] // 2, c["ctx"] + 1, (c["B"],), device="cuda", generator=g,
                                     dtype=torch.int32))
        descs = [tma_descs(x[1], x[2]) for x in ins]
        scale = 1 / math.sqrt(c["D"])
        kv_bytes = sum(int(x) for x in ins[0][6].tolist()) * c["Hkv"] * c["D"] * 2 * 2
        ref = paged_decode_attention(*ins[0][0:3], ins[0][5], ins[0][6], scale).float()
        t_eng = graph_time(lambda i: paged_decode_attention(*ins[i][0:3], ins[i][5], ins[i][6], scale), copies)
        res = []
        for pages, stages, warps in itertools.product((1, 2), (3, 5, 8), (4, 8)):
            kw = dict(pages=pages, stages=stages, num_warps=warps)
            out = tma_decode(*ins[0][0:3], ins[0][5], ins[0][6], scale, descs=descs[0], **kw).float()
            err = (out - ref).abs().max().item()
            t = graph_time(lambda i: tma_decode(*ins[i][0:3], ins[i][5], ins[i][6], scale, descs=descs[i], **kw),
                           copies)
            res.append((t, kw, err))
        res.sort(key=lambda r: r[0])
        t_eng2 = graph_time(lambda i: paged_decode_attention(*ins[i][0:3], ins[i][5], ins[i][6], scale), copies)
        print(f"{c}: engine {t_eng * 1e6:.2f} / {t_eng2 * 1e6:.2f} us, KV at 3.0 TB/s {kv_bytes / 3.0e12 * 1e6:.2f}",
              flush=True)
        for t, kw, err in res[:5]:
            print(f"   tma {t * 1e6:6.2f} us {kw} max diff {err:.2e}", flush=True)
        rows.append({"case": c, "kv_bytes": kv_bytes, "engine_us": [t_eng * 1e6, t_eng2 * 1e6],
                     "tma": [{"us": t * 1e6, **kw, "max_diff": e} for t, kw, e in res]})
    write_json(a.json, gpu_and_date() | {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
