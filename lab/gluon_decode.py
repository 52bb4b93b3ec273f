"""Decode attention for 64-wide heads in Gluon: the pages of a 128-token tile by TMA, a producer warp
keeping STAGES tiles in flight ahead of one consumer warpgroup.

    python -m lab.gluon_decode --out gluon-decode.json

The engine's kernel (kernels/paged_attention.py, the "fat" plan for 128-255 (sequence, KV head)
pairs) gathers each tile's K and V through the block table with plain loads, and Triton's pipeliner
keeps num_stages - 1 tiles in flight: Qwen2.5-0.5B's 64 sequences at ~576 tokens take ~11.5 us a
layer cold, where their 18.9 MB take 6.3 at the copy bandwidth and a TMA stream of the same bytes
8.5 (bench/NOTES.md, 2026-11-27). lab/tma_decode.py took the pages by TMA but ran the online softmax
per 16-token page and lost (20.9 us). Here one program per (sequence, KV head) does what
kernels/prefill_ws.py does for a cached prefix: a 1-warp producer loads a tile's 8 pages as 8 TMA
boxes into one [128, D] buffer of a ring, and the consumer warpgroup runs one softmax per tile: S =
Q K^T (wgmma, the GROUP query heads as rows of a 64-row tile, the rest zero), the row max and
exponentials, O += P V (wgmma). Keys past the sequence are masked; V rows past it are zeroed by the
producer before the consumer sees them (stale slots: 0 * NaN is not 0), as prefill_ws does.

Compared in the same call with the engine's kernel on the same inputs (outputs within bf16
rounding), per layer in CUDA graphs over 24 layers' pages (cold L2). On an H100 (2026-11-28,
bench/NOTES.md) as fast as the engine's kernel for Qwen2.5-0.5B's heads and slower for
SmolLM2-135M's: one program per pair, the longest sequence and a fixed ramp set both kernels' time.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                    warpgroup_mma_wait)

    from kernels.prefill_ws import _layout, _load_pages, _page_descriptor, _zero_rows_from
except ImportError:  # a Triton without Gluon
    gluon = None

ROWS = 64  # a wgmma tile's rows: the GROUP query heads, zero-padded


if gluon is not None:
    _ROWS = gl.constexpr(ROWS)

    @gluon.jit
    def _produce(kc_desc, vc_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, v_tma, bt_ptr, sl_ptr,
                 stride_btb, NUM_KV_HEADS: gl.constexpr, STAGES: gl.constexpr):
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        BLOCK_SIZE: gl.constexpr = kc_desc.block_type.shape[0]
        PAGES: gl.constexpr = BLOCK_N // BLOCK_SIZE
        b = gl.program_id(0)
        kvh = gl.program_id(1)
        seq_len = gl.load(sl_ptr + b)
        last_page = (seq_len - 1) // BLOCK_SIZE
        bt_row = bt_ptr + b.to(gl.int64) * stride_btb
        for t in range(gl.cdiv(seq_len, BLOCK_N)):
            idx = t % STAGES
            phase = (t // STAGES) & 1
            # a fresh mbarrier counts as having completed the phase before phase 0
            mbarrier.wait(k_empty.index(idx), phase ^ 1)
            _load_pages(kc_desc, bt_row, t * PAGES, last_page, kvh, k_ready.index(idx), k_bufs.index(idx),
                        NUM_KV_HEADS)
            mbarrier.wait(v_empty.index(idx), phase ^ 1)
            valid = seq_len - t * BLOCK_N
            if valid < BLOCK_N:  # the last tile, partial: its stale V rows zeroed first (one tile a program)
                _load_pages(vc_desc, bt_row, t * PAGES, last_page, kvh, v_tma, v_bufs.index(idx), NUM_KV_HEADS)
                mbarrier.wait(v_tma, 0)
                _zero_rows_from(v_bufs.index(idx), valid)
                fence_async_shared()
                mbarrier.arrive(v_ready.index(idx), count=1)
            else:
                _load_pages(vc_desc, bt_row, t * PAGES, last_page, kvh, v_ready.index(idx), v_bufs.index(idx),
                            NUM_KV_HEADS)

    @gluon.jit
    def _consume(q_ptr, out_ptr, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, sl_ptr, qk_scale,
                 stride_qb, stride_qh, stride_ob, stride_oh, GROUP: gl.constexpr, STAGES: gl.constexpr):
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
        dtype: gl.constexpr = k_bufs.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        q_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        b = gl.program_id(0)
        kvh = gl.program_id(1)
        seq_len = gl.load(sl_ptr + b)

        g = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, ld))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        q_off = b.to(gl.int64) * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = gl.load(q_ptr + q_off, mask=(g < GROUP)[:, None], other=0.0)
        q = gl.convert_layout(q, q_op_layout)

        zero_s = gl.zeros([_ROWS, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([_ROWS, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([_ROWS], gl.float32, row_s)
        for t in range(gl.cdiv(seq_len, BLOCK_N)):
            idx = t % STAGES
            phase = (t // STAGES) & 1
            mbarrier.wait(k_ready.index(idx), phase)
            s = warpgroup_mma(q, k_bufs.index(idx).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            mbarrier.arrive(k_empty.index(idx), count=1)
            key = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where((key < seq_len)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # qk_scale > 0
            p = gl.exp2(s * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            m_i = m_new
            l_i = l_i * alpha + gl.sum(p, axis=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(idx), phase)
            acc = warpgroup_mma(p_op, v_bufs.index(idx), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(v_empty.index(idx), count=1)

        l_o = gl.convert_layout(l_i, row_o)
        out = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
        rows = gl.arange(0, _ROWS, layout=row_o)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_off = b.to(gl.int64) * stride_ob + (kvh * GROUP + rows)[:, None] * stride_oh + cols[None, :]
        gl.store(out_ptr + o_off, out.to(dtype), mask=(rows < GROUP)[:, None])

    @gluon.jit(do_not_specialize_on_alignment=["bt_ptr", "sl_ptr"])
    def _gluon_decode_kernel(q_ptr, out_ptr, kc_desc, vc_desc, bt_ptr, sl_ptr, qk_scale, stride_qb, stride_qh,
                             stride_ob, stride_oh, stride_btb, GROUP: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        HEAD_DIM: gl.constexpr = kc_desc.block_type.shape[1]
        k_bufs = gl.allocate_shared_memory(kc_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], kc_desc.layout)
        v_bufs = gl.allocate_shared_memory(vc_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], vc_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_tma = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(v_tma, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=1)
        gl.warp_specialize([(_consume, (q_ptr, out_ptr, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, sl_ptr,
                                        qk_scale, stride_qb, stride_qh, stride_ob, stride_oh, GROUP, STAGES)),
                            (_produce, (kc_desc, vc_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, v_tma,
                                        bt_ptr, sl_ptr, stride_btb, NUM_KV_HEADS, STAGES))],
                           [1], [40])


def launch_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, out: torch.Tensor, block_n: int = 128,
                stages: int = 4) -> tuple:
    """(grid, args, kwargs): q [B, Hq, D], pages [num_blocks, Hkv, block_size, D] of q's 16-bit dtype."""
    from kernels.attn_common import LOG2E

    B, Hq, D = q.shape
    Hkv, bs = k_cache.shape[1], k_cache.shape[2]
    # 64-token tiles (8 stages) gave wrong outputs on an H100 (max difference 0.2-0.7); not looked into
    assert Hq % Hkv == 0 and Hq // Hkv <= ROWS and D in (64, 128) and block_n == 128 and block_n % bs == 0
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    tile = _layout(q.dtype, block_n, D)
    args = (q, out, _page_descriptor(k_cache, tile), _page_descriptor(v_cache, tile), block_tables, seq_lens,
            scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0))
    return (B, Hkv), args, dict(GROUP=Hq // Hkv, NUM_KV_HEADS=Hkv, BLOCK_N=block_n, STAGES=stages, num_warps=4)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, block_n: int = 128, stages: int = 4,
           out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    grid, args, kwargs = launch_args(q, k_cache, v_cache, block_tables, seq_lens, scale, out, block_n, stages)
    _gluon_decode_kernel[grid](*args, **kwargs)
    return out


# (model, Hq, Hkv, batch, shortest and longest context)
CASES = (("qwen2.5-0.5b", 14, 2, 64, 512, 640), ("qwen2.5-0.5b", 14, 2, 48, 100, 300),
         ("qwen2.5-0.5b", 14, 2, 64, 1500, 2000), ("smollm2-135m", 9, 3, 64, 512, 640))
PLANS = ((128, 4), (128, 2), (128, 6))  # (block_n, stages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.gluon_decode", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--contiguous", action="store_true",
                   help="each sequence's pages in order, one after another (default: a random set of pages)")
    p.add_argument("--plans", default=",".join(f"{n}x{s}" for n, s in PLANS), help="BLOCK_NxSTAGES,...")
    a = p.parse_args(argv)

    from kernels import reference
    from kernels.paged_attention import paged_decode_attention
    from lab.kernels import decode_inputs, gpu_and_date, graph_us, write_json

    D, bs = 64, 16
    plans = [tuple(int(v) for v in x.split("x")) for x in a.plans.split(",")]
    rows = []
    for model, hq, hkv, B, lo, hi in CASES:
        row: dict = {"model": model, "heads": [hq, hkv, D], "batch": B, "context": [lo, hi],
                     "contiguous_pages": a.contiguous}
        try:
            layers = []
            for i in range(a.layers):
                q, kc, vc, _, _, bt, sl = decode_inputs(B, hi, hq, hkv, D, bs, None, seed=i, contiguous=a.contiguous)
                g = torch.Generator(device="cuda").manual_seed(100 + i)
                sl = torch.randint(lo, hi + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
                layers.append((q, kc, vc, bt, sl))
            q, kc, vc, bt, sl = layers[0]
            scale = D ** -0.5
            ref = reference.paged_decode_attention(q, kc, vc, bt, sl, scale)
            eng = paged_decode_attention(q, kc, vc, bt, sl, scale)
            row["engine_max_diff"] = float((eng.float() - ref.float()).abs().max())
            outs = [torch.empty_like(x[0]) for x in layers]
            row["engine_us"] = round(graph_us(lambda: [paged_decode_attention(*x, scale, out=o)
                                                       for x, o in zip(layers, outs)], per=a.layers), 2)
            for block_n, stages in plans:
                key = f"gluon_{block_n}x{stages}"
                try:
                    got = decode(q, kc, vc, bt, sl, scale, block_n, stages)
                    row[f"{key}_max_diff"] = float((got.float() - ref.float()).abs().max())
                    row[f"{key}_us"] = round(graph_us(lambda bn=block_n, st=stages: [
                        decode(*x, scale, bn, st, out=o) for x, o in zip(layers, outs)], per=a.layers), 2)
                except Exception as e:  # noqa: BLE001 - a plan that does not fit is a result
                    row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            layers.clear()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_json(a.out, gpu_and_date() | {"layers": a.layers, "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
