"""Decode paged attention: one query token per sequence over its block table (split-K).

Grid (batch, kv head, split). A program takes the GROUP query heads that share one KV head
(padded to BLOCK_G >= 16 rows so the products run on the tensor cores) and one partition of the
sequence, walks it in tiles of TILE_N tokens gathered through the block table, and keeps an
online softmax in float32: each KV page is read once for the whole group. Quantized pages
(fp8 e4m3 / int8) are converted to float16 in registers (kv_to_dot); the per-token K scale
multiplies the scores and the per-token V scale the probabilities, so dequantizing costs one
multiply per token, not per element. A bf16 query is divided by its row max before it is cast
to float16 (no overflow) and the max goes back into the scores. With more than one split, each
program stores its partial result and log-sum-exp and counts its arrival on a per-(sequence, KV
head) counter; the last to arrive merges the splits and sets the counter back to zero. That saves
the merge kernel's launch per layer (Qwen2.5-0.5B decode graphs on an H100: merge kernel 1.8 us,
the decode kernel 1.6 us slower with the merge inside; an eager step launches one kernel less).

CUDA-graph safety: the grid and the number of splits depend only on shapes (batch, heads,
head_dim, block_tables.shape[1], block_size); seq_lens is read on the device only. Each split
takes an equal share of its own sequence (whole tiles, at least MIN_TILES_PER_SPLIT), computed in
the kernel, so a 600-token context spreads over the splits a 32k-token table width plans for;
splits past a sequence's end do no work (but still arrive) and the merge skips them. The counters
live for the process (kernels/launch.py arrival_counters): captured graphs hold their address.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attn_common import LOG2E, QUANT_CODE, check_paged, check_scales, kv_to_dot, mma
from kernels.fused import rotary_row, rotate_rows
from kernels.launch import arrival_counters, bind, launch, next_pow2
from kernels.pdl import wait_for_prior


@triton.jit
def _partition(seq_len, TILE_N: tl.constexpr, MIN_TILES: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Tokens per split of one sequence: its own length over the splits, in whole tiles (at least
    MIN_TILES), so a short context still spreads over the splits that a long one would fill."""
    tiles = tl.maximum((seq_len + NUM_SPLITS * TILE_N - 1) // (NUM_SPLITS * TILE_N), MIN_TILES)
    return tiles * TILE_N


# seq_lens is a view into each step's upload buffer at an offset that varies with the step's shape
# (decode graphs read an aligned static copy): specializing on its alignment made eager mixed steps
# compile new variants mid-serving, ~0.6 s each (lab/first_use.py). It is read one scalar at a time.
@triton.jit(do_not_specialize_on_alignment=["sl_ptr", "pos_ptr", "slot_ptr"])
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr,
    out_ptr, po_ptr, plse_ptr, count_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_ch, stride_ct,
    stride_sb, stride_sh, stride_btb,
    stride_pb, stride_ph,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MIN_TILES: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, QUANT: tl.constexpr, NATIVE: tl.constexpr,
    PREFETCH: tl.constexpr, ROTARY: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + b)
    part = _partition(seq_len, TILE_N, MIN_TILES, NUM_SPLITS)
    start = split * part
    end = tl.minimum(start + part, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    if ROTARY:
        # q, k, v are this step's projections, not yet rotated, and the pages lack the new token
        q, m_i, l_i, acc, end = _rotate_and_store_new(
            q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr, b, kvh, heads, gmask,
            seq_len, start, end, qk_scale, m_i, l_i, acc, stride_qb, stride_qh, stride_kt, stride_kh,
            stride_vt, stride_vh, stride_cs, stride_cb, stride_ch, stride_ct,
            BLOCK_G, HEAD_DIM, BLOCK_SIZE)
    else:
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
    if QUANT and q.dtype == tl.bfloat16:
        # float16 products: scale each row into [-1, 1] first, put the max back into the scores
        qf = q.to(tl.float32)
        qmax = tl.max(tl.abs(qf), axis=1)
        qmax = tl.where(qmax > 0, qmax, 1.0)
        q = (qf / qmax[:, None]).to(tl.float16)
        row_scale = qmax * qk_scale
    else:
        row_scale = tl.full([BLOCK_G], 1.0, tl.float32) * qk_scale
    dot_ty: tl.constexpr = q.dtype

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    head_off = kvh.to(tl.int64) * stride_ch
    # PREFETCH: the block-table entries of the next tile are loaded one iteration ahead
    # (loop-carried), so the K/V loads depend on no load of their own iteration and Triton's
    # pipeliner keeps num_stages - 1 tiles of them in flight; with the lookup inline it waits for
    # each tile before computing on it. That matters where few programs share an SM (quantized
    # pages: ~255 registers; bf16 grids of <= ~2 programs an SM); with many bf16 programs an SM
    # they hide the latency instead and the inline lookup measured faster (decode_config).
    pos0 = start + tl.arange(0, TILE_N)
    blk_next = tl.load(bt_row + pos0 // BLOCK_SIZE, mask=pos0 < end, other=0)  # unused unless PREFETCH
    # quantized V pages are [HEAD_DIM, BLOCK_SIZE] (kvcache/quant.py); a tile of whole pages (tiles
    # start at multiples of TILE_N) is loaded page by page, BLOCK_SIZE tokens contiguous
    V_PAGES: tl.constexpr = QUANT != 0 and TILE_N >= BLOCK_SIZE
    if V_PAGES:
        pg = tl.arange(0, TILE_N // BLOCK_SIZE)
        jj = tl.arange(0, BLOCK_SIZE)
        vblk_next = tl.load(bt_row + start // BLOCK_SIZE + pg, mask=start + pg * BLOCK_SIZE < end, other=0)
    for tok0 in range(start, end, TILE_N):
        pos = tok0 + tl.arange(0, TILE_N)
        valid = pos < end
        if PREFETCH:
            blk = blk_next.to(tl.int64)
            npos = pos + TILE_N
            blk_next = tl.load(bt_row + npos // BLOCK_SIZE, mask=npos < end, other=0)
        else:
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        row = blk * stride_cb + head_off + off * stride_ct
        k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if V_PAGES:
            vblk = vblk_next.to(tl.int64)
            vblk_next = tl.load(bt_row + (tok0 + TILE_N) // BLOCK_SIZE + pg,
                                mask=tok0 + TILE_N + pg * BLOCK_SIZE < end, other=0)
            # masked by whole pages; slots past the end in the last page hold finite values (the
            # pool starts zeroed), which p = 0 cancels
            vp = vc_ptr + (vblk * stride_cb + head_off)[:, None, None] + d[None, :, None] * BLOCK_SIZE + jj[None, None, :]
            v3 = tl.load(vp, mask=(tok0 + pg * BLOCK_SIZE < end)[:, None, None], other=0.0)
            v = tl.reshape(tl.permute(v3, (0, 2, 1)), (TILE_N, HEAD_DIM))
        elif QUANT:
            v = tl.load(vc_ptr + (blk * stride_cb + head_off + off)[:, None] + d[None, :] * BLOCK_SIZE,
                        mask=valid[:, None], other=0.0)
        else:
            v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = mma(q, tl.trans(kv_to_dot(k, dot_ty, QUANT)), NATIVE) * row_scale[:, None]
        if QUANT:
            srow = blk * stride_sb + kvh * stride_sh + off
            k_sc = tl.load(ks_ptr + srow, mask=valid, other=0.0)
            v_sc = tl.load(vs_ptr + srow, mask=valid, other=0.0)
            s = s * k_sc[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            # per-token V scales, normalized by the tile's largest so float16 keeps precision
            v_max = tl.max(v_sc, axis=0)
            p = p * (v_sc / v_max)[None, :]
            pv = mma(p.to(dot_ty), kv_to_dot(v, dot_ty, QUANT), NATIVE) * v_max
        else:
            pv = mma(p.to(dot_ty), v.to(dot_ty), NATIVE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        base = b.to(tl.int64) * stride_pb + heads * stride_ph + split
        tl.store(po_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(plse_ptr + base, m_i + tl.log2(l_safe), mask=gmask)
        # every thread's stores are issued before the (one-thread) release of the arrival
        tl.debug_barrier()
        counter = count_ptr + b * tl.num_programs(1) + kvh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            _merge_splits(out_ptr, po_ptr, plse_ptr, sl_ptr, b, heads, gmask,
                          stride_ob, stride_oh, stride_pb, stride_ph,
                          BLOCK_G, HEAD_DIM, TILE_N, MIN_TILES, NUM_SPLITS, BLOCK_S)
            tl.store(counter, 0)  # the next launch (layer, graph replay) starts from zero


@triton.jit
def _rotate_and_store_new(
    q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr, b, kvh, heads, gmask,
    seq_len, start, end, qk_scale, m_i, l_i, acc, stride_qb, stride_qh, stride_kt, stride_kh,
    stride_vt, stride_vh, stride_cs, stride_cb, stride_ch, stride_ct,
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Rotary embedding and the KV write inside decode attention (unquantized pages): every program
    rotates its group's q rows; the one whose part holds the new token (position seq_len - 1)
    rotates that token's k, stores k and v into their slot, and takes the token's score from
    registers as the online softmax's first entry, so its loop stops before it and never reads
    the slot it has just written. -> (q rotated, m_i, l_i, acc, end)."""
    d = tl.arange(0, HEAD_DIM)
    dsw = (d + HEAD_DIM // 2) % HEAD_DIM  # rotate_half's partner of each element
    c, s = rotary_row(cs_ptr, tl.load(pos_ptr + b).to(tl.int64), stride_cs, q_ptr.dtype.element_ty, HEAD_DIM)
    qrow = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q = rotate_rows(tl.load(qrow + d[None, :], mask=gmask[:, None], other=0.0),
                    tl.load(qrow + dsw[None, :], mask=gmask[:, None], other=0.0), c[None, :], s[None, :])
    last = seq_len - 1
    if (start <= last) & (last < end):  # this program's part holds the new token
        krow = kn_ptr + b.to(tl.int64) * stride_kt + kvh * stride_kh
        cdt = kc_ptr.dtype.element_ty
        k = rotate_rows(tl.load(krow + d), tl.load(krow + dsw), c, s).to(cdt)
        v = tl.load(vn_ptr + b.to(tl.int64) * stride_vt + kvh * stride_vh + d).to(cdt)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if slot >= 0:  # -1: a padded graph row, written nowhere
            page = (slot // BLOCK_SIZE) * stride_cb + kvh * stride_ch + (slot % BLOCK_SIZE) * stride_ct + d
            tl.store(kc_ptr + page, k)
            tl.store(vc_ptr + page, v)
        m_i = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * qk_scale
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32) + v.to(tl.float32)[None, :]
        end = last
    return q, m_i, l_i, acc, end


@triton.jit
def _merge_splits(
    out_ptr, po_ptr, plse_ptr, sl_ptr, b, heads, gmask,
    stride_ob, stride_oh, stride_pb, stride_ph,
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr, MIN_TILES: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out[b, heads] from the splits' partials, weighted by their log-sum-exps (max-subtracted), in
    split order whichever program runs it. Partials are read from L2 (.cg): other SMs wrote them."""
    seq_len = tl.load(sl_ptr + b)  # again: one register less across the main loop
    part = _partition(seq_len, TILE_N, MIN_TILES, NUM_SPLITS)
    n_used = tl.minimum((seq_len + part - 1) // part, NUM_SPLITS)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    base = b.to(tl.int64) * stride_pb + heads * stride_ph
    smask = gmask[:, None] & (s[None, :] < n_used)
    lse = tl.load(plse_ptr + base[:, None] + s[None, :], mask=smask, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, axis=1)
    m = tl.where(gmask, m, 0.0)  # padding rows: no -inf - -inf
    w = tl.where(smask, tl.exp2(lse - m[:, None]), 0.0)
    o = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for i in tl.range(0, n_used, num_stages=1):
        w_i = tl.sum(tl.where(s[None, :] == i, w, 0.0), axis=1)
        po = tl.load(po_ptr + (base + i)[:, None] * HEAD_DIM + d[None, :], mask=gmask[:, None], other=0.0,
                     cache_modifier=".cg")
        o += po * w_i[:, None]
    o = o / tl.where(gmask, tl.sum(w, axis=1), 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


MIN_TILES_PER_SPLIT = 2  # a split's share of a sequence: at least this many tiles (pipelining needs a few)
# Programs the split count aims at: ~256 measured best for bf16 and fp8 pages alike, from 8 to 512
# (batch, KV head) pairs; more splits cost their partial results and the merge (bench/KERNELS.md, run 9).
TARGET_PROGRAMS = 256


def decode_config(batch: int, num_kv_heads: int, max_context: int, head_dim: int, fp32: bool,
                  quant: bool = False) -> dict:
    """Launch parameters from shapes alone (never from seq_lens). Tuned on an H100 for Llama-3-8B
    heads (bench/KERNELS.md): bf16 pages 64-token tiles, the block-table lookup prefetched only
    where programs are few (64-wide heads at about one (sequence, KV head) an SM: one 8-warp
    program of 128-token tiles each); fp8/int8 pages 128-token tiles with the lookup prefetched (fewer,
    fatter programs: the conversion to fp16 needs registers)."""
    stages, maxnreg = (2 if fp32 else 3), None
    pairs = next_pow2(batch) * num_kv_heads  # (sequence, KV head) pairs, the batch rounded as below
    # bf16 pages, 64-wide heads, about one pair an SM: one fat program each (128-token tiles, 8 warps)
    # instead of two splits and their merge. Cold L2 (bench/NOTES.md, 2026-11-27): Qwen heads B64 x
    # 512-640 12.6 -> 11.6 us a layer, x 4,096 the same; the 0.5B's decode step -3.8 to -5.1%. Fewer
    # pairs keep the splits (B16: 7.8 against 10.4 us), more keep 64-token tiles (B256: 30.8 against 36.7 us).
    fat = not fp32 and not quant and head_dim <= 64 and TARGET_PROGRAMS // 2 <= pairs < TARGET_PROGRAMS
    if fp32:  # float32 products run on the FMA units: 16-token tiles keep them out of local memory
        tile_n, prefetch = 16, quant
    elif quant:
        tile_n, prefetch = (128 if head_dim <= 128 else 32), True
        if head_dim <= 128:  # measured at 64 and 128 (lab/decode_occupancy.py)
            # two stages (42 KB of shared memory) and at most 128 registers: 4 programs per SM
            # instead of 2-3 (Llama-3-8B heads, batch 64, 4,096 tokens, fp8 pages: 223 vs 261 us)
            stages, maxnreg = 2, 128
    else:
        tile_n, prefetch = (128 if fat else min(64, 8192 // head_dim)), False
    tile_n = max(16, min(tile_n, next_pow2(max_context)))
    # Enough programs to fill the GPU; at most 32 splits and at least 4 tiles per split. The batch
    # is rounded up to a power of two: the split count is a compile-time constant, and eager mixed
    # steps (any number of decodes) then reuse the variants compiled for the decode graphs.
    want = max(1, math.ceil(TARGET_PROGRAMS / pairs))
    splits = 1 if fat else max(1, min(want, 32, math.ceil(max_context / (4 * tile_n))))
    if not fp32 and not quant:
        # bf16 pages: the lookup one tile ahead pays where programs are few (<= 256, about two
        # an SM) and costs where they are many. Cold L2, 2-24 layers in a CUDA graph (bench/NOTES.md,
        # 2026-11-23): Qwen heads B64 x 512-640 14.2 -> 12.6 us, B64 x 4,096 60.0 -> 51.5,
        # B16 1.03x, Llama heads B8 x 4,096 1.03x; at 512 programs Llama B64 0.91-0.94x, Qwen B256 0.99x.
        prefetch = pairs * splits <= TARGET_PROGRAMS
    return {"tile_n": tile_n, "num_splits": splits, "num_warps": 8 if fat else 4, "num_stages": stages,
            "maxnreg": maxnreg, "prefetch": prefetch, "min_tiles": MIN_TILES_PER_SPLIT}


def _q_out_key(q: torch.Tensor, out: torch.Tensor | None) -> tuple:
    return q.shape, q.stride(), q.dtype, None if out is None else out.stride()


# positions of the arguments a reused launch replaces (kernel parameter order)
_ARG_Q, _ARG_KC, _ARG_VC, _ARG_KS, _ARG_VS, _ARG_OUT, _ARG_SCALE = 0, 1, 2, 3, 4, 7, 11
_ARG_KN, _ARG_VN, _ARG_POS, _ARG_CS, _ARG_SLOT = 24, 25, 26, 27, 28


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, config: dict | None = None,
                           reuse: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """Decode: one query token per sequence, q [B, num_heads, head_dim] -> [B, num_heads, head_dim].

    `config` overrides keys of decode_config()'s choice (benchmarks and tests only).
    `reuse`: a dict that lives for one step (attention metadata) and is passed with the same
    block_tables and seq_lens every time, e.g. by every layer. The first call checks the
    arguments, plans the launch and keeps it there; later calls with caches and q of the same
    shapes and dtypes only relaunch it on their own q, caches, scales and out (an eager step pays
    the wrapper's host time once instead of once per layer).
    """
    quant = QUANT_CODE.get(k_cache.dtype, 0)
    ks, vs = (k_scale, v_scale) if quant else (k_cache, k_cache)
    changes = ((_ARG_Q, q), (_ARG_KC, k_cache), (_ARG_VC, v_cache), (_ARG_KS, ks), (_ARG_VS, vs))
    return _decode(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, softmax_scale, out, config,
                   reuse, pdl, None, changes)


def rotary_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            softmax_scale: float, out: torch.Tensor | None = None, config: dict | None = None,
                            reuse: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """A decode step's attention from its unrotated projections, over unquantized pages: the
    rotary embedding of q [B, Hq, D] and k [B, Hkv, D] (kernels/fused.py apply_rotary), the new
    k and v into their slots (-1: written nowhere) and paged_decode_attention, in one kernel: one
    launch less per layer. q and k are not modified. seq_lens count the new token; positions and
    cos_sin as for apply_rotary; config, reuse and pdl as for paged_decode_attention."""
    changes = ((_ARG_Q, q), (_ARG_KC, k_cache), (_ARG_VC, v_cache), (_ARG_KS, k_cache), (_ARG_VS, k_cache),
               (_ARG_KN, k), (_ARG_VN, v), (_ARG_POS, positions), (_ARG_CS, cos_sin), (_ARG_SLOT, slot_mapping))
    return _decode(q, k_cache, v_cache, None, None, block_tables, seq_lens, softmax_scale, out, config, reuse,
                   pdl, (k, v, positions, cos_sin, slot_mapping), changes)


def _check_rotary(q: torch.Tensor, k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor, cos_sin: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    assert QUANT_CODE.get(k_cache.dtype, 0) == 0 and k_cache.dtype == q.dtype, "pages in q's dtype only"
    B, Hkv, D = k.shape
    assert q.shape[0] == B and q.shape[2] == D and k.dtype == q.dtype and v.dtype == q.dtype
    assert v.shape == k.shape and k.stride(2) == 1 and v.stride(2) == 1, "k/v last dim must be contiguous"
    assert k_cache.shape[1] == Hkv, f"k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}"
    assert positions.shape == (B,) and not positions.dtype.is_floating_point
    assert slot_mapping.shape == (B,) and not slot_mapping.dtype.is_floating_point
    assert cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, D) and cos_sin.dtype == torch.float32
    assert cos_sin.stride(2) == 1 and cos_sin.stride(1) == D


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None, block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
            out: torch.Tensor | None, config: dict | None, reuse: dict | None, pdl: bool,
            rotary: tuple | None, changes: tuple) -> torch.Tensor:
    """Both entry points: the reused launch when the step planned one, else check, plan, launch.
    changes: (position, value) of the arguments a reused launch replaces, out and scale aside."""
    name = "decode" if rotary is None else "decode_rotary"
    if reuse is not None:
        caller_out = out
        short = (k_cache.shape, k_cache.dtype, None if k_scale is None else k_scale.stride(), pdl)
        hit = reuse.get(name)
        # the plan's own q and out objects (every layer of a piecewise step): their shapes need no check
        if hit is not None and hit[1] == short and (
                (out is not None and hit[2] is q and hit[3] is out) or hit[0] == _q_out_key(q, out)):
            if out is None:
                out = torch.empty_like(q)
            hit[4](changes + ((_ARG_OUT, out), (_ARG_SCALE, softmax_scale * LOG2E)))
            return out
    B, Hq, D = q.shape
    nb, Hkv, bs, Dc = k_cache.shape
    quant = QUANT_CODE.get(k_cache.dtype, 0)
    check_paged(q, k_cache, v_cache, block_tables, B)
    assert seq_lens.shape == (B,) and seq_lens.dtype == torch.int32
    if quant:
        check_scales(k_scale, v_scale, (nb, Hkv, bs))
        ks, vs = k_scale, v_scale
    else:
        assert k_cache.dtype in (torch.bfloat16, torch.float16, torch.float32)
        ks = vs = k_cache  # unused
    if rotary is not None:
        _check_rotary(q, k_cache, *rotary)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if B == 0:
        return out
    group = Hq // Hkv
    fp32 = q.dtype == torch.float32
    max_context = block_tables.shape[1] * bs
    cfg = decode_config(B, Hkv, max_context, D, fp32, quant > 0)
    cfg.update(config or {})
    tile_n = cfg["tile_n"]
    # each sequence's own length is split in the kernel; this only bounds the count by max_context
    min_tiles = cfg["min_tiles"]
    splits = min(cfg["num_splits"], math.ceil(max_context / (min_tiles * tile_n)))
    if splits > 1:
        po = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
        plse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
        counters = arrival_counters(q.device, B * Hkv)
    else:
        po = plse = counters = out  # unused
    pdl = pdl and q.is_cuda
    if rotary is None:
        kn = vn = pos = cs = slot = q  # unused
    else:
        kn, vn, pos, cs, slot = rotary
    main = (bind if reuse is not None else launch)(_decode_kernel, (B, Hkv, splits),
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, out, po, plse, counters,
        softmax_scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1), block_tables.stride(0),
        Hq * splits, splits,
        kn, vn, pos, cs, slot, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cs.stride(0),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=D,
        BLOCK_SIZE=bs, TILE_N=tile_n, MIN_TILES=min_tiles, NUM_SPLITS=splits, BLOCK_S=max(2, next_pow2(splits)),
        QUANT=quant, NATIVE=not fp32 and q.is_cuda, PREFETCH=bool(cfg["prefetch"]), ROTARY=rotary is not None, PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        **({} if rotary is None else {"enable_fp_fusion": False}),  # rounds like torch (fused.rotate_rows)
    )
    if reuse is not None and main is not None:  # None: launched the normal way (interpreter, profiler hooks)
        reuse[name] = (_q_out_key(q, caller_out), short, q, caller_out, main)
    return out
