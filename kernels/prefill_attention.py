"""Prefill attention: varlen causal attention of each sequence's new tokens over its pages.

The new tokens of sequence i are q[query_start_loc[i]:query_start_loc[i+1]], the LAST q_len
positions of a sequence of seq_lens[i] tokens whose K/V (cached prefix and new tokens alike) are
already in the pages. FlashAttention-style: a program owns BLOCK_M query rows, walks the keys in
tiles with an online softmax and float32 accumulation, in two parts:

- the cached prefix (positions < seq_len - q_len), gathered through the block table in tiles of
  BLOCK_N_PREFIX keys: every query row sees all of it, so only a last partial tile is masked;
- the chunk's own new keys, in tiles of BLOCK_N counted from the chunk's first token (plain
  causal attention): tiles below the query tile need no mask, only the diagonal ones are masked.
  When the caller passes this step's contiguous k, v [T, num_kv_heads, head_dim] (the values the
  engine has just copied into the pages, bit for bit) and the pages are unquantized in k's dtype,
  the new keys are read from k, v with strided loads (SRC_PTR) or TMA tensor descriptors
  (SRC_TMA, Hopper) instead of block-table gathers; otherwise from the pages (SRC_PAGES).

Grid (batch * heads, query tiles), the last query tiles (the longest rows) first; neighbouring
heads share a KV head in L2. With a work list (`work`, int32 items (b << 16) | query tile, the
caller's order) the grid is (heads, len(work)) instead, fixed for a CUDA graph whatever the step's
chunks: an item whose tile starts past its chunk (e.g. WORK_PAD) does nothing, and b indexes
seq_lens, query starts and block tables directly, so the query starts are rows of q itself.
PACK_GQA: a program takes the GROUP query heads of one KV head for BLOCK_M // GROUP tokens, so
each K/V tile serves all of them (short chunks fill the tile; the diagonal is narrower).
Quantized pages are handled as in paged_attention.py (float16 products, scales folded in).
On an H100, with 16-bit pages and this step's k/v, chunks longer than 64 tokens go to
prefill_ws.py's warp-specialized Gluon kernel instead (prefill_plan()'s "ws").
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import prefill_ws
from kernels.attn_common import LOG2E, QUANT_CODE, check_paged, check_scales, kv_to_dot, mma
from kernels.launch import TensorDescriptor, bind, cdiv, launch, next_pow2

# where the new keys are read: the pages, k/v with strided loads, k/v through TMA descriptors
SRC_PAGES, SRC_PTR, SRC_TMA = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
SRC_WS = 3  # (plans only) the whole launch goes to prefill_ws.py's Hopper kernel instead
# chunks of at most this many tokens stay on this file's kernel (its tiles of 16-64 rows waste
# less on short chunks than the Hopper kernel's 128)
WS_MIN_QUERY_LEN = 65
# and for heads of at most 64 dims, chunks shorter than this too: in the engine's own mixed steps
# of a 64-wide-head model (H100, bench/NOTES.md 2026-11-28) this file's kernel took 9.1 us a layer
# where the Hopper kernel took 19.1 for a 512-token chunk, and the step 3-11% less with one to four
# such chunks. The bound is the whole-step graphs' largest step (EngineConfig.step_graph_max_tokens).
# After a cached prefix of 2,048-4,096 tokens the Hopper kernel's step was 6-22% shorter for models
# of 14-32 heads (not SmolLM2's 9), but a plan that follows the prefix must leave the graphs, whose
# piecewise launches took that back (bench/NOTES.md, 2026-11-28, "a chunk's plan by its prefix")
WS_NARROW_MIN_QUERY_LEN = 2305


@triton.jit
def _attend(acc, l_i, m_i, q, row_scale, qk_scale, q_idx, k_src, v_src, ks_ptr, vs_ptr, bt_row, kvh, pos0, lo, hi,
            stride_k, stride_v, stride_cb, stride_ct, stride_sb, stride_sh, row0, col0,
            dot_ty: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, SRC: tl.constexpr, QUANT: tl.constexpr, NATIVE: tl.constexpr,
            LAZY: tl.constexpr):
    """Keys j in [lo, hi) of one part, at sequence positions pos0 + j. MASKED: 0 none, 1 keys
    j >= hi, 2 also causal (j > q_idx). SRC_PAGES: k_src/v_src point at this KV head in the pages;
    SRC_PTR: at this KV head of the part's first row of k/v (row stride stride_k/stride_v);
    SRC_TMA: descriptors over k/v as [T, kv_heads * head_dim], the part's first row row0, col0."""
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    if SRC == SRC_PAGES:
        blk_next = tl.load(bt_row + (pos0 + lo + n) // BLOCK_SIZE, mask=lo + n < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        j = start + n
        if MASKED:
            kmask = j < hi
        if SRC == SRC_PAGES:
            pos = pos0 + j
            blk = blk_next.to(tl.int64)
            # the next tile's page numbers one iteration ahead (lets the pipeliner overlap)
            blk_next = tl.load(bt_row + (pos + BLOCK_N) // BLOCK_SIZE, mask=j + BLOCK_N < hi, other=0)
            off = pos % BLOCK_SIZE
            row = blk * stride_cb + off * stride_ct
            if QUANT:  # quantized V pages are [HEAD_DIM, BLOCK_SIZE] (kvcache/quant.py)
                v_ptrs = v_src + (blk * stride_cb + off)[:, None] + d[None, :] * BLOCK_SIZE
            else:
                v_ptrs = v_src + row[:, None] + d[None, :]
            if MASKED:
                k = tl.load(k_src + row[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
            else:
                k = tl.load(k_src + row[:, None] + d[None, :])
                v = tl.load(v_ptrs)
        elif SRC == SRC_PTR:
            if MASKED:
                k = tl.load(k_src + j[:, None] * stride_k + d[None, :], mask=kmask[:, None], other=0.0)
                v = tl.load(v_src + j[:, None] * stride_v + d[None, :], mask=kmask[:, None], other=0.0)
            else:
                k = tl.load(k_src + j[:, None] * stride_k + d[None, :])
                v = tl.load(v_src + j[:, None] * stride_v + d[None, :])
        else:
            # rows past the chunk are another sequence's keys or TMA's zero fill: finite, masked below
            k = k_src.load([row0 + start, col0])
            v = v_src.load([row0 + start, col0])
        if QUANT:
            s = mma(q, tl.trans(kv_to_dot(k, dot_ty, QUANT)), NATIVE) * row_scale[:, None]
            srow = blk * stride_sb + kvh * stride_sh + off
            if MASKED:
                k_sc = tl.load(ks_ptr + srow, mask=kmask, other=0.0)
                v_sc = tl.load(vs_ptr + srow, mask=kmask, other=0.0)
            else:
                k_sc = tl.load(ks_ptr + srow)
                v_sc = tl.load(vs_ptr + srow)
            s = s * k_sc[None, :]
        else:
            s = mma(q, tl.trans(k.to(dot_ty)), NATIVE)  # raw scores: the scale goes into one FMA below
        if MASKED == 1:
            s = tl.where(kmask[None, :], s, float("-inf"))
        elif MASKED == 2:
            s = tl.where((j[None, :] <= q_idx[:, None]) & kmask[None, :], s, float("-inf"))
        if QUANT:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # qk_scale > 0
        if LAZY:
            # keep the running max unless some row's grew by more than 2^8 (then rescale all rows):
            # p <= 256 then, exact after the final division by l; the rescale is rarely needed
            if tl.max(m_new - m_i, axis=0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            if QUANT:
                p = tl.exp2(s - m_i[:, None])
            else:
                p = tl.exp2(s * qk_scale - m_i[:, None])
            l_i = l_i + tl.sum(p, axis=1)
        else:
            if QUANT:
                p = tl.exp2(s - m_new[:, None])
            else:
                p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            m_i = m_new
        if QUANT:
            v_max = tl.max(v_sc, axis=0)
            p = p * (v_sc / v_max)[None, :]
            acc += mma(p.to(dot_ty), kv_to_dot(v, dot_ty, QUANT), NATIVE) * v_max
        elif NATIVE:
            acc = tl.dot(p.to(dot_ty), v.to(dot_ty), acc)
        else:
            acc += mma(p.to(dot_ty), v.to(dot_ty), NATIVE)
    return acc, l_i, m_i


# a work item that does nothing: query tile 0xFFFF of sequence 0 starts past any chunk
WORK_PAD = 0xFFFF


# Per-step values are not specialized on (==1, divisible by 16, 16-byte aligned), so a step with an
# unusual number of tiles or of decodes ahead of it (mixed batches pass seq_lens[num_decode:])
# reuses a compiled kernel instead of stalling for a compile in the middle of serving.
@triton.jit(do_not_specialize=["num_m_tiles"],
            do_not_specialize_on_alignment=["bt_ptr", "sl_ptr", "qsl_ptr", "work_ptr"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, k_new, v_new, bt_ptr, sl_ptr, qsl_ptr, work_ptr, out_ptr,
    qk_scale, num_m_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_ct,
    stride_sb, stride_sh, stride_btb,
    stride_kt, stride_kh, stride_vt, stride_vh,
    PROG_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TOK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_PREFIX: tl.constexpr,
    NEW_SRC: tl.constexpr, PACK_GQA: tl.constexpr, QUANT: tl.constexpr, NATIVE: tl.constexpr,
    LAZY: tl.constexpr, WORK: tl.constexpr,
):
    if WORK:
        item = tl.load(work_ptr + tl.program_id(1))
        b = item >> 16
        m_tile = item & 0xFFFF
        hp = tl.program_id(0)
    else:
        pid_bh = tl.program_id(0)
        m_tile = num_m_tiles - 1 - tl.program_id(1)  # longest rows first
        b = pid_bh // PROG_HEADS
        hp = pid_bh % PROG_HEADS
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(sl_ptr + b)
    # cached prefix; q_len > seq_len (no valid chunk: the runner's profiling pass) reads no keys
    # outside [0, seq_len) and nothing of k/v beyond the chunk
    prefix = tl.maximum(seq_len - q_len, 0)
    kv_new = seq_len - prefix  # == q_len for valid input
    r = tl.arange(0, BLOCK_M)
    if PACK_GQA:  # rows (token, head of the group), heads fastest; TOK_M = BLOCK_M // GROUP
        kvh = hp
        m_start = m_tile * TOK_M
        tok = m_start + r // GROUP
        head = kvh * GROUP + r % GROUP
    else:  # TOK_M = BLOCK_M
        kvh = hp // GROUP
        m_start = m_tile * TOK_M
        tok = m_start + r
        head = hp

    d = tl.arange(0, HEAD_DIM)
    rmask = tok < q_len
    q_rows = (q_start + tok).to(tl.int64)
    if PACK_GQA:
        q_off = q_rows[:, None] * stride_qt + (head * stride_qh)[:, None] + d[None, :]
    else:
        q_off = q_rows[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=rmask[:, None], other=0.0)
    if QUANT and q.dtype == tl.bfloat16:
        qf = q.to(tl.float32)
        qmax = tl.max(tl.abs(qf), axis=1)
        qmax = tl.where(qmax > 0, qmax, 1.0)
        q = (qf / qmax[:, None]).to(tl.float16)
        row_scale = qmax * qk_scale
    else:  # (unquantized pages scale the raw scores inside the exp2's FMA instead)
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    kc_head = kc_ptr + kvh.to(tl.int64) * stride_ch
    vc_head = vc_ptr + kvh.to(tl.int64) * stride_ch
    if m_start < q_len:
        # 1. the cached prefix: every row sees all of it; the last partial tile masks keys >= prefix
        prefix_full = (prefix // BLOCK_N_PREFIX) * BLOCK_N_PREFIX
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, row_scale, qk_scale, tok, kc_head, vc_head, ks_ptr, vs_ptr,
                                bt_row, kvh, 0, 0, prefix_full, 0, 0, stride_cb, stride_ct, stride_sb, stride_sh,
                                0, 0, q.dtype, HEAD_DIM, BLOCK_SIZE, BLOCK_N_PREFIX, 0, SRC_PAGES, QUANT, NATIVE,
                                LAZY)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, row_scale, qk_scale, tok, kc_head, vc_head, ks_ptr, vs_ptr,
                                bt_row, kvh, 0, prefix_full, prefix, 0, 0, stride_cb, stride_ct, stride_sb, stride_sh,
                                0, 0, q.dtype, HEAD_DIM, BLOCK_SIZE, BLOCK_N_PREFIX, 1, SRC_PAGES, QUANT, NATIVE,
                                LAZY)
        # 2. the chunk's new keys j (position prefix + j): below the tile's first token no mask,
        #    then the diagonal with the causal mask j <= tok
        new_full = (tl.minimum(m_start, kv_new) // BLOCK_N) * BLOCK_N
        diag_end = tl.minimum(m_start + TOK_M, kv_new)
        if NEW_SRC == SRC_PAGES:
            k_src = kc_head
            v_src = vc_head
        elif NEW_SRC == SRC_PTR:
            k_src = k_new + (q_start.to(tl.int64) * stride_kt + kvh.to(tl.int64) * stride_kh)
            v_src = v_new + (q_start.to(tl.int64) * stride_vt + kvh.to(tl.int64) * stride_vh)
        else:
            k_src = k_new
            v_src = v_new
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, row_scale, qk_scale, tok, k_src, v_src, ks_ptr, vs_ptr,
                                bt_row, kvh, prefix, 0, new_full, stride_kt, stride_vt, stride_cb, stride_ct,
                                stride_sb, stride_sh, q_start, kvh * HEAD_DIM, q.dtype, HEAD_DIM, BLOCK_SIZE,
                                BLOCK_N, 0, NEW_SRC, QUANT, NATIVE, LAZY)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, row_scale, qk_scale, tok, k_src, v_src, ks_ptr, vs_ptr,
                                bt_row, kvh, prefix, new_full, diag_end, stride_kt, stride_vt, stride_cb, stride_ct,
                                stride_sb, stride_sh, q_start, kvh * HEAD_DIM, q.dtype, HEAD_DIM, BLOCK_SIZE,
                                BLOCK_N, 2, NEW_SRC, QUANT, NATIVE, LAZY)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        acc = acc / l_safe[:, None]
        if PACK_GQA:
            o_off = q_rows[:, None] * stride_ot + (head * stride_oh)[:, None] + d[None, :]
        else:
            o_off = q_rows[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def prefill_config(max_query_len: int, head_dim: int, fp32: bool, quant: bool = False, new_kv: bool = False,
                   group: int = 1) -> dict:
    """Launch configuration from the longest query chunk, head_dim, the page dtype, whether the new
    keys come from the contiguous k/v (new_kv) and the GQA group size (query heads per KV head).

    block_m query rows per program; block_n keys per tile of the new-token part, block_n_prefix
    per tile of the cached prefix (page gathers); tma: new keys through TMA descriptors;
    pack_gqa: a program takes the group's heads for block_m // group tokens; lazy_rescale: skip
    the accumulator rescale unless a row's max grew by more than 2^8 (see _attend).

    All-pages path (fp8/int8 pages, or no k/v): measured on an H100 (bench/KERNELS.md): bf16 best
    at 128 x 32 tiles, 4 warps, 3 stages; quantized pages convert K/V in registers, so 64-row tiles
    keep them from spilling. new_kv path (16-bit pages), from the H100 sweep of 42 configurations
    (bench/KERNELS.md, run 5): 64 x 64 tiles, 4 warps, 3 stages, new keys through TMA, no GQA
    packing, no lazy rescale (its two barriers per tile cost more than the skipped rescales)."""
    base = {"block_n_prefix": 32, "tma": False, "pack_gqa": False, "lazy_rescale": False}
    if fp32:
        # float32 products run on the FMA units; larger tiles spill registers (sm_90, head_dim 128)
        return {**base, "block_m": 16, "block_n": 16, "block_n_prefix": 16, "num_warps": 4, "num_stages": 2}
    if new_kv and head_dim <= 128:
        block_m = min(64, max(16, next_pow2(max_query_len)))
        return {**base, "block_m": block_m, "block_n": 64, "num_warps": 4, "num_stages": 3, "tma": True}
    cap = 32 if quant and head_dim > 128 else 64 if quant or head_dim > 128 else 128
    block_m = min(cap, max(16, next_pow2(max_query_len)))
    return {**base, "block_m": block_m, "block_n": 32, "num_warps": 4, "num_stages": 3}


def _tma_ok(t: torch.Tensor) -> bool:
    """k/v [T, Hkv, D] viewable as a 2-D [T, Hkv * D] TMA tensor, with Triton's host descriptors."""
    return TensorDescriptor is not None and prefill_ws.tma_2d(t)


def prefill_plan(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int, config: dict | None = None,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> dict:
    """The launch the wrapper makes: prefill_config()'s choice updated by `config`, with the
    requests that cannot apply dropped, plus src (SRC_PAGES / SRC_PTR / SRC_TMA: where the new
    keys are read) and tok_m (tokens per program)."""
    Hq, D = q.shape[1], q.shape[2]
    group = Hq // k_cache.shape[1]
    quant = QUANT_CODE.get(k_cache.dtype, 0)
    # the new keys may come from k/v only where the pages hold exactly k/v's values
    new_kv = k is not None and not quant and k.dtype == k_cache.dtype and v.dtype == k_cache.dtype
    cfg = prefill_config(max_query_len, D, q.dtype == torch.float32, quant > 0, new_kv, group)
    cfg.update(config or {})
    cfg["pack_gqa"] = bool(cfg["pack_gqa"]) and group > 1 and group & (group - 1) == 0 and cfg["block_m"] % group == 0
    cfg["lazy_rescale"] = bool(cfg["lazy_rescale"])
    cfg["tok_m"] = cfg["block_m"] // group if cfg["pack_gqa"] else cfg["block_m"]
    cfg["src"] = SRC_PAGES.value
    if new_kv:
        cfg["src"] = (SRC_TMA if cfg["tma"] and _tma_ok(k) and _tma_ok(v) else SRC_PTR).value
    cfg["tma"] = cfg["src"] == SRC_TMA.value
    # the Hopper kernel by default (for 64-wide heads from WS_NARROW_MIN_QUERY_LEN tokens); a config
    # asks for it by "ws": True (its other keys are this file's)
    ws = (config or {}).get("ws", None if not config else False)
    min_len = WS_NARROW_MIN_QUERY_LEN if ws is None and D <= 64 else WS_MIN_QUERY_LEN
    want_ws = ws is not False and max_query_len >= min_len
    cfg["ws"] = bool(want_ws and new_kv and prefill_ws.ws_available(q) and prefill_ws.ws_supports(q, k, v, k_cache, k_cache))
    if cfg["ws"]:
        cfg.update(src=SRC_WS, block_m=prefill_ws.BLOCK_M, tok_m=prefill_ws.BLOCK_M, block_n=prefill_ws.BLOCK_N,
                   pack_gqa=False, lazy_rescale=False, tma=True, num_warps=4, num_stages=prefill_ws.STAGES)
    return cfg


def work_list(seqs: list[int], q_lens: list[int], tok_m: int, size: int) -> np.ndarray | None:
    """The `work` items of chunks of q_lens[i] tokens of sequences seqs[i] (indices into seq_lens),
    in tiles of tok_m tokens: the last tiles (the longest rows) first, as the plain grid runs them,
    padded to `size` with WORK_PAD items; None when there are more than `size`."""
    items = sorted(((m, s) for s, n in zip(seqs, q_lens) for m in range(cdiv(n, tok_m))), key=lambda it: -it[0])
    if len(items) > size:
        return None
    out = np.full(size, WORK_PAD, dtype=np.int32)
    out[:len(items)] = [(s << 16) | m for m, s in items]
    return out


def _tensors_key(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out: torch.Tensor | None) -> tuple:
    return (q.shape, q.stride(), q.dtype, None if k is None else (k.shape, k.stride(), v.stride()),
            None if out is None else out.stride())


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            softmax_scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, max_query_len: int | None = None,
                            config: dict | None = None, k: torch.Tensor | None = None,
                            v: torch.Tensor | None = None, out: torch.Tensor | None = None,
                            reuse: dict | None = None, work: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each sequence's pages -> [T, num_heads, head_dim].

    k, v [T, num_kv_heads, head_dim] (optional): this step's new keys/values, row for row with q,
    already written to the pages. With unquantized pages of k's dtype the new-token part of the key
    loop reads them instead of the pages (the same values); otherwise, or when None, everything
    comes from the pages. `config` overrides keys of prefill_config()'s choice (benchmarks and
    tests only); requests that do not apply (tma, pack_gqa) are dropped. `out`: where to write the
    result (a [T, num_heads, head_dim] view with contiguous rows), instead of a new tensor.
    `reuse`: as for paged_decode_attention: one step's dict, passed with the same block_tables,
    seq_lens and query_start_loc each time; later calls of the same shapes relaunch the first's plan.
    `work`: int32 [N] work items (module docstring), one program per item and head, planned for
    max_query_len (prefill_plan()'s tok_m is the tile the items count in); no reuse with it.
    """
    if reuse is not None:
        caller = (q, k, v, out)
        short = (k_cache.shape, k_cache.dtype, max_query_len, None if k_scale is None else k_scale.stride())
        hit = reuse.get("prefill")
        # the plan's own q, k, v, out objects (every layer of a piecewise step): their shapes need no check
        if hit is not None and hit[1] == short and (
                (out is not None and hit[2][0] is q and hit[2][1] is k and hit[2][2] is v and hit[2][3] is out)
                or hit[0] == _tensors_key(*caller)):
            _, _, _, main, src, block_n, k0 = hit
            if src == SRC_WS:
                if out is None:
                    out = torch.empty_like(q)
                main(prefill_ws.relaunch_changes(q, k, v, k_cache, v_cache, out, softmax_scale, main.args))
                return out
            new_desc = src == SRC_TMA.value and k.data_ptr() != k0
            if not new_desc or (_tma_ok(k) and _tma_ok(v)):
                if out is None:
                    out = torch.empty_like(q)
                ks, vs = (k_scale, v_scale) if QUANT_CODE.get(k_cache.dtype, 0) else (k_cache, k_cache)
                changes = [(0, q), (1, k_cache), (2, v_cache), (3, ks), (4, vs), (11, out), (12, softmax_scale * LOG2E)]
                if src == SRC_PTR.value:
                    changes += [(5, k), (6, v)]
                elif new_desc:
                    T, Hkv, D = k.shape
                    box = [block_n, D]
                    changes += [(5, TensorDescriptor(k, [T, Hkv * D], [k.stride(0), 1], box)),
                                (6, TensorDescriptor(v, [T, Hkv * D], [v.stride(0), 1], box))]
                main(tuple(changes))
                return out
    T, Hq, D = q.shape
    nb, Hkv, bs, Dc = k_cache.shape
    B = seq_lens.shape[0]
    check_paged(q, k_cache, v_cache, block_tables, B)
    assert seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
    assert query_start_loc.shape == (B + 1,)
    assert (k is None) == (v is None), "pass both k and v or neither"
    if work is not None:
        assert reuse is None and max_query_len is not None, "a work list takes max_query_len and no reuse"
        assert work.dtype == torch.int32 and work.dim() == 1 and work.stride(0) == 1
    quant = QUANT_CODE.get(k_cache.dtype, 0)
    if quant:
        check_scales(k_scale, v_scale, (nb, Hkv, bs))
        ks, vs = k_scale, v_scale
    else:
        assert k_cache.dtype in (torch.bfloat16, torch.float16, torch.float32)
        ks = vs = k_cache  # unused
    if k is not None:
        assert k.shape == (T, Hkv, D) and v.shape == (T, Hkv, D), "k/v must be [T, num_kv_heads, head_dim]"
        assert k.stride(2) == 1 and v.stride(2) == 1, "k/v last dim must be contiguous"
    assert softmax_scale > 0
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if B else 0
    if T == 0 or B == 0 or max_query_len == 0:
        return out
    plan = prefill_plan(q, k_cache, max_query_len, config, k, v)
    if plan["ws"]:
        grid, args, kwargs = prefill_ws.ws_launch_args(q, k, v, k_cache, v_cache, block_tables, seq_lens,
                                                       query_start_loc, out, softmax_scale, max_query_len, work)
        main = (bind if reuse is not None else launch)(prefill_ws._prefill_ws_kernel, grid, *args, **kwargs)
        if main is not None:
            reuse["prefill"] = (_tensors_key(*caller), short, caller, main, SRC_WS, 0, 0)
        return out
    src, pack, block_m, tok_m = plan["src"], plan["pack_gqa"], plan["block_m"], plan["tok_m"]
    k_arg = v_arg = k_cache  # unused
    if src != SRC_PAGES.value:
        assert max(k.stride(0), v.stride(0)) * T < 2**31, "k/v too large for int32 offsets"
    if src == SRC_PTR.value:
        k_arg, v_arg = k, v
    elif src == SRC_TMA.value:
        box = [plan["block_n"], D]
        k_arg = TensorDescriptor(k, [T, Hkv * D], [k.stride(0), 1], box)
        v_arg = TensorDescriptor(v, [T, Hkv * D], [v.stride(0), 1], box)
    num_m_tiles = cdiv(max_query_len, tok_m)
    prog_heads = Hkv if pack else Hq
    grid = (B * prog_heads, num_m_tiles) if work is None else (prog_heads, work.shape[0])
    sk = k.stride() if src != SRC_PAGES.value else (0, 0, 1)
    sv = v.stride() if src != SRC_PAGES.value else (0, 0, 1)
    main = (bind if reuse is not None else launch)(_prefill_kernel, grid,
        q, k_cache, v_cache, ks, vs, k_arg, v_arg, block_tables, seq_lens, query_start_loc,
        query_start_loc if work is None else work, out,
        softmax_scale * LOG2E, num_m_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1), block_tables.stride(0),
        sk[0], sk[1], sv[0], sv[1],
        PROG_HEADS=prog_heads, GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_SIZE=bs,
        BLOCK_M=block_m, TOK_M=tok_m, BLOCK_N=plan["block_n"], BLOCK_N_PREFIX=plan["block_n_prefix"],
        NEW_SRC=src, PACK_GQA=pack, QUANT=quant, NATIVE=q.dtype != torch.float32 and q.is_cuda,
        LAZY=plan["lazy_rescale"], WORK=work is not None, num_warps=plan["num_warps"], num_stages=plan["num_stages"],
    )
    if main is not None:
        reuse["prefill"] = (_tensors_key(*caller), short, caller, main, src, plan["block_n"],
                            k.data_ptr() if k is not None else 0)
    return out
