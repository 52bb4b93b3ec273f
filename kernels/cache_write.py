"""Scatter new K/V into the paged cache by slot mapping, quantizing on write for fp8/int8.

Page layout and scale convention: kvcache/spec.py, kvcache/quant.py. One program per
(token, kv head): it reads the head's head_dim values of K and of V, and for a quantized cache
computes the base scale = amax(|x|) / QMAX (1.0 for an all-zero head), q = x / scale (int8: round
half to even, clamp to +-127; fp8: round half to even onto e4m3), and stores q and scale. Given
the tokens' queries, K's scale is instead the one of NC candidates base * (1 + j * STEP) whose
rounding changes the token's own scores least (kvcache/quant.py): all NC roundings are one
[NC, head_dim] tile, in one warp (measured fastest on the H100: bench/NOTES.md). Slot -1 (a padded
CUDA-graph slot) writes nothing.

Bit for bit the reference's result, except where two candidates' score errors agree to float32
rounding: the kernel sums them in its own order and may then pick the other scale (codes are
always the rounding of x at the scale stored).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.attn_common import check_scales
from kernels.launch import launch
from kernels.pdl import wait_for_prior
from kvcache.quant import NUM_CANDIDATES, STEP, v_page_shape

_QMAX = {"fp8": 448.0, "int8": 127.0}
_STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@triton.jit
def _base_scale(x, QMAX: tl.constexpr, RCP: tl.constexpr):
    """amax(|x|) / QMAX (1 for an all-zero x), computed the way torch computes kvcache/quant.py's
    `amax / qmax` on the same device, so both paths store identical bits: on CUDA torch multiplies
    by the float32 reciprocal of a scalar divisor (RCP, passed as that float32 value), on the CPU
    it divides."""
    amax = tl.max(tl.abs(x), axis=0)
    if RCP != 0.0:
        scale = tl.where(amax > 0, amax * RCP, 1.0)
    else:
        scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
    return scale


@triton.jit
def _round(y, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """float32 y -> the stored values as float32: clamped to +-QMAX, then int8: round half to even
    (the 1.5 * 2**23 trick is exact for |y| < 2**22); fp8 e4m3: round half to even onto the e4m3
    grid here, so the cast at the store is exact."""
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if QUANT == 2:
        y = (y + 12582912.0) - 12582912.0
    else:
        y = _round_to_e4m3(y)
    return y


@triton.jit
def _key_scale(k, q_row_ptr, stride_qh, base, QUANT: tl.constexpr, QMAX: tl.constexpr,
               HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NC: tl.constexpr, STEP: tl.constexpr):
    """The candidate scale base * (1 + j * STEP) whose rounding of k [HEAD_DIM] moves the scores
    of the GROUP queries at q_row_ptr (rows stride_qh apart) least; the smallest j on ties."""
    j = tl.arange(0, NC)
    d = tl.arange(0, HEAD_DIM)
    scales = base * (1.0 + j.to(tl.float32) * STEP)  # [NC]
    inv = tl.math.div_rn(tl.full([NC], 1.0, tl.float32), scales)  # torch's 1 / scales, bit for bit
    e = _round(k[None, :] * inv[:, None], QUANT, QMAX) * scales[:, None] - k[None, :]  # [NC, HEAD_DIM]
    err = tl.zeros([NC], dtype=tl.float32)
    for g in tl.static_range(GROUP):
        qg = tl.load(q_row_ptr + g * stride_qh + d).to(tl.float32)
        s = tl.sum(e * qg[None, :], axis=1)
        err = err + s * s
    best = tl.argmin(err, axis=0, tie_break_left=True)
    return tl.min(tl.where(j == best, scales, float("inf")), axis=0)


@triton.jit
def _fp8_bits(y, x):
    """e4m3 bits of y (already on the e4m3 grid, |y| <= 448) with x's sign bit: torch keeps the
    sign of values that round to zero (-0 = 0x80); float arithmetic on zeros need not. Packed by
    integer ops, not by a cast: the H100's packed fp32 -> e4m3 conversion lost every second value
    of one-warp programs (triton 3.6)."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) - 120) << 3) | ((bits >> 20) & 7))  # biased exponent 7, 3 mantissa bits
    sub = (a * 512.0).to(tl.int32)  # below 2**-6: multiples of 2**-9, codes 0..7
    code = tl.where(a >= 0.015625, normal, sub)
    sign = (x.to(tl.float32).to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def _round_to_e4m3(y):
    """Round float32 |y| <= 448 to the nearest e4m3 value (ties to even), staying in float32.

    The cast to float8e4nv would round too, but Triton's CPU interpreter mis-rounds values that
    carry into the next binade (e.g. 127.4 -> 64); with the value already on the grid every
    backend casts exactly.
    """
    bits = y.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # e4m3 subnormals share the spacing of the smallest binade
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv_ulp = ((127 - (exp - 3)) << 23).to(tl.float32, bitcast=True)
    r = ((y * inv_ulp) + 12582912.0) - 12582912.0  # y * inv_ulp is exact, |y * inv_ulp| < 16
    return r * ulp


@triton.jit
def _to_storage(x, dst_ty: tl.constexpr):
    """Cast to the cache dtype. float32 -> bf16 rounds to nearest even by hand: the result is the
    same as the hardware cast, and Triton's CPU interpreter would otherwise truncate."""
    if dst_ty == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dst_ty)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_qt, stride_qh,
    stride_cb, stride_ch, stride_ct,
    stride_sb, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, RCP: tl.constexpr,
    GROUP: tl.constexpr, NC: tl.constexpr, STEP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d)
        dst = blk * stride_cb + h * stride_ch + off * stride_ct + d
        if QUANT == 0:
            tl.store(kc_ptr + dst, _to_storage(k, kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + dst, _to_storage(v, vc_ptr.dtype.element_ty))
        else:
            kf = k.to(tl.float32)
            vf = v.to(tl.float32)
            ks = _base_scale(kf, QMAX, RCP)
            vs = _base_scale(vf, QMAX, RCP)
            if GROUP > 0:  # the queries of this KV head: q heads h * GROUP .. h * GROUP + GROUP - 1
                q_row = q_ptr + t.to(tl.int64) * stride_qt + (h * GROUP) * stride_qh
                ks = _key_scale(kf, q_row, stride_qh, ks, QUANT, QMAX, HEAD_DIM, GROUP, NC, STEP)
            kq = _round(tl.math.div_rn(kf, ks), QUANT, QMAX)
            vq = _round(tl.math.div_rn(vf, vs), QUANT, QMAX)
            # V pages are [head_dim, block_size] (kvcache/quant.py)
            vdst = blk * stride_cb + h * stride_ch + d * BLOCK_SIZE + off
            if QUANT == 2:
                tl.store(kc_ptr + dst, kq.to(tl.int8))
                tl.store(vc_ptr + vdst, vq.to(tl.int8))
            else:  # fp8 pages arrive as uint8 views: store the bits, with the sign bit of x
                tl.store(kc_ptr + dst, _fp8_bits(kq, k))
                tl.store(vc_ptr + vdst, _fp8_bits(vq, v))
            sdst = blk * stride_sb + h * stride_sh + off
            tl.store(ks_ptr + sdst, ks)
            tl.store(vs_ptr + sdst, vs)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, kv_dtype: str | None = None,
                   q: torch.Tensor | None = None, pdl: bool = False) -> None:
    """Scatter k, v [T, num_kv_heads, head_dim] into the pages; quantize when kv_dtype is fp8/int8.
    q [T, num_heads, head_dim]: the same tokens' queries, which pick K's scales (kvcache/quant.py);
    ignored by unquantized caches. pdl: launch with programmatic dependent launch (kernels/pdl.py)."""
    T, H, D = k.shape
    nb, Hc, bs, Dc = k_cache.shape
    v_shape = v_page_shape(k_cache.shape, kv_dtype in _QMAX)
    assert v.shape == k.shape and v_cache.shape == v_shape, f"v_cache {tuple(v_cache.shape)} != {tuple(v_shape)}"
    assert (Hc, Dc) == (H, D), f"cache heads/head_dim {(Hc, Dc)} != k's {(H, D)}"
    assert D & (D - 1) == 0, "head_dim must be a power of two"
    assert slot_mapping.shape == (T,) and not slot_mapping.dtype.is_floating_point
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v last dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    group, step = 0, 0.0
    if kv_dtype in _QMAX:
        assert k_cache.dtype == _STORAGE[kv_dtype] and v_cache.dtype == _STORAGE[kv_dtype]
        check_scales(k_scale, v_scale, (nb, H, bs))
        quant, qmax = (1 if kv_dtype == "fp8" else 2), _QMAX[kv_dtype]
        ks, vs = k_scale, v_scale
        if q is not None:
            assert q.shape[0] == T and q.shape[2] == D and q.shape[1] % H == 0, f"q {tuple(q.shape)} vs k {(T, H, D)}"
            assert q.stride(2) == 1, "q's last dim must be contiguous"
            group, step = q.shape[1] // H, STEP[kv_dtype]
    else:
        assert kv_dtype is None, f"kv_dtype must be None, 'fp8' or 'int8'; got {kv_dtype!r}"
        assert k_cache.dtype in (torch.float32, torch.float16, torch.bfloat16)
        quant, qmax = 0, 1.0
        ks = vs = k_cache  # unused
    if T == 0:
        return
    if group == 0:
        q = k  # unused
    kc, vc = k_cache, v_cache
    if quant == 1:
        kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    pdl = pdl and k.is_cuda
    launch(_write_kv_kernel, (T, H),
        k, v, q, kc, vc, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1),
        BLOCK_SIZE=bs, HEAD_DIM=D, QUANT=quant, QMAX=qmax,
        RCP=float(np.float32(1.0) / np.float32(qmax)) if k.is_cuda else 0.0,
        GROUP=group, NC=NUM_CANDIDATES if group else 1, STEP=step,
        PDL=pdl, num_warps=1 if group else 4, launch_pdl=pdl,
    )
