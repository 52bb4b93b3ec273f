"""Prefill attention: varlen causal attention of each sequence's new tokens over its pages.

The new tokens of sequence i are q[query_start_loc[i]:query_start_loc[i+1]], the LAST q_len
positions of a sequence of seq_lens[i] tokens whose K/V (cached prefix and new tokens alike) are
already in the pages. FlashAttention-style: a program owns BLOCK_M query rows of one head, walks
the keys in tiles of BLOCK_N gathered through the block table, with an online softmax and float32
accumulation. Keys below the tile's first query position need no mask (the cached prefix and the
earlier new tokens); only the tiles on the diagonal are masked. Grid (batch * heads, query tiles),
the last query tiles (the longest rows) first; neighbouring heads share a KV head in L2.
Quantized pages are handled as in paged_attention.py (float16 products, scales folded in).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attn_common import LOG2E, QUANT_CODE, kv_to_dot, mma


@triton.jit
def _prefill_tile(acc, l_i, m_i, q, row_scale, q_pos, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, head_off,
                  kvh, seq_len, lo, hi, stride_cb, stride_ct, stride_sb, stride_sh,
                  dot_ty: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr, NATIVE: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    key0 = lo + tl.arange(0, BLOCK_N)
    blk_next = tl.load(bt_row + key0 // BLOCK_SIZE, mask=key0 < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        blk = blk_next.to(tl.int64)
        nkey = key + BLOCK_N
        blk_next = tl.load(bt_row + nkey // BLOCK_SIZE, mask=nkey < hi, other=0)
        if MASKED:
            kmask = key < seq_len
        off = key % BLOCK_SIZE
        row = blk * stride_cb + head_off + off * stride_ct
        if MASKED:
            k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        else:
            k = tl.load(kc_ptr + row[:, None] + d[None, :])
            v = tl.load(vc_ptr + row[:, None] + d[None, :])
        s = mma(q, tl.trans(kv_to_dot(k, dot_ty, QUANT)), NATIVE) * row_scale[:, None]
        if QUANT:
            srow = blk * stride_sb + kvh * stride_sh + off
            if MASKED:
                k_sc = tl.load(ks_ptr + srow, mask=kmask, other=0.0)
                v_sc = tl.load(vs_ptr + srow, mask=kmask, other=0.0)
            else:
                k_sc = tl.load(ks_ptr + srow)
                v_sc = tl.load(vs_ptr + srow)
            s = s * k_sc[None, :]
        if MASKED:
            s = tl.where((key[None, :] <= q_pos[:, None]) & kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            v_max = tl.max(v_sc, axis=0)
            p = p * (v_sc / v_max)[None, :]
            pv = mma(p.to(dot_ty), kv_to_dot(v, dot_ty, QUANT), NATIVE) * v_max
        else:
            pv = mma(p.to(dot_ty), v.to(dot_ty), NATIVE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, qsl_ptr, out_ptr,
    qk_scale, num_m_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_ct,
    stride_sb, stride_sh, stride_btb,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, NATIVE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    m_tile = num_m_tiles - 1 - tl.program_id(1)  # longest rows first
    b = pid_bh // NUM_HEADS
    h = pid_bh % NUM_HEADS
    kvh = h // GROUP
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(sl_ptr + b)
    prefix = seq_len - q_len
    m_start = m_tile * BLOCK_M

    offs_m = m_start + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    rmask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rmask[:, None], other=0.0)
    if QUANT and q.dtype == tl.bfloat16:
        qf = q.to(tl.float32)
        qmax = tl.max(tl.abs(qf), axis=1)
        qmax = tl.where(qmax > 0, qmax, 1.0)
        q = (qf / qmax[:, None]).to(tl.float16)
        row_scale = qmax * qk_scale
    else:
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    head_off = kvh.to(tl.int64) * stride_ch
    if m_start < q_len:
        # keys every row of the tile sees: no mask
        full_end = ((prefix + m_start) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, row_scale, q_pos, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                                      bt_row, head_off, kvh, seq_len, 0, full_end,
                                      stride_cb, stride_ct, stride_sb, stride_sh, q.dtype, HEAD_DIM,
                                      BLOCK_SIZE, BLOCK_N, False, QUANT, NATIVE)
        # the diagonal: causal mask
        diag_end = tl.minimum(prefix + m_start + BLOCK_M, seq_len)
        acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, row_scale, q_pos, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                                      bt_row, head_off, kvh, seq_len, full_end, diag_end,
                                      stride_cb, stride_ct, stride_sb, stride_sh, q.dtype, HEAD_DIM,
                                      BLOCK_SIZE, BLOCK_N, True, QUANT, NATIVE)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        acc = acc / l_safe[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def prefill_config(max_query_len: int, head_dim: int, fp32: bool, quant: bool = False) -> dict:
    """Tile sizes from the longest query chunk, head_dim and the page dtype. Tuned on an H100
    (bench/KERNELS.md): 128 x 32 tiles over 4 warps, 3 stages for bf16 pages; quantized pages
    convert K/V in registers, so 64-row tiles keep them from spilling."""
    if fp32:
        # float32 products run on the FMA units; larger tiles spill registers (sm_90, head_dim 128)
        return {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}
    cap = 32 if quant and head_dim > 128 else 64 if quant or head_dim > 128 else 128
    block_m = min(cap, max(16, triton.next_power_of_2(max_query_len)))
    return {"block_m": block_m, "block_n": 32, "num_warps": 4, "num_stages": 3}


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            softmax_scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, max_query_len: int | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over each sequence's pages -> [T, num_heads, head_dim].

    `config` overrides keys of prefill_config()'s choice (benchmarks and tests only).
    """
    T, Hq, D = q.shape
    nb, Hkv, bs, Dc = k_cache.shape
    B = seq_lens.shape[0]
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype, "k/v caches differ"
    assert Dc == D and Hq % Hkv == 0, f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}"
    assert D & (D - 1) == 0 and 16 <= D <= 256, "head_dim must be a power of two in 16..256"
    assert bs & (bs - 1) == 0, "block_size must be a power of two"
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32) and q.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert seq_lens.dtype == torch.int32 and query_start_loc.dtype == torch.int32
    assert query_start_loc.shape == (B + 1,)
    quant = QUANT_CODE.get(k_cache.dtype, 0)
    if quant:
        assert k_scale is not None and v_scale is not None, "fp8/int8 caches need k_scale and v_scale"
        assert k_scale.shape == (nb, Hkv, bs) and v_scale.shape == k_scale.shape
        assert k_scale.dtype == torch.float32 and k_scale.is_contiguous() and v_scale.is_contiguous()
        ks, vs = k_scale, v_scale
    else:
        assert k_cache.dtype in (torch.bfloat16, torch.float16, torch.float32)
        ks = vs = k_cache  # unused
    out = torch.empty_like(q)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if B else 0
    if T == 0 or B == 0 or max_query_len == 0:
        return out
    fp32 = q.dtype == torch.float32
    cfg = prefill_config(max_query_len, D, fp32, quant > 0)
    cfg.update(config or {})
    num_m_tiles = triton.cdiv(max_query_len, cfg["block_m"])
    _prefill_kernel[(B * Hq, num_m_tiles)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, query_start_loc, out,
        softmax_scale * LOG2E, num_m_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1), block_tables.stride(0),
        NUM_HEADS=Hq, GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_SIZE=bs,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], QUANT=quant, NATIVE=not fp32 and q.is_cuda,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
