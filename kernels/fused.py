"""Fused elementwise ops: RMSNorm (+ residual add), neox rotary embedding, SiLU-and-multiply.

Each kernel reproduces the rounding of the torch reference (kernels/reference.py): intermediate
results that torch rounds to the model dtype are rounded here too, so outputs match to within
the last bit of the dtype. lab/kernels.py records whether each fusion beats torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, launch, next_pow2
from kernels.pdl import wait_for_prior

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, order_ptr, out_ptr, res_out_ptr, eps,
                     stride_x, stride_r, stride_o, stride_ro, N,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    normed = (h * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(out_ptr.dtype.element_ty)
    if ORDERED:  # output column j is column order[j]: the row's values exchanged on chip
        y = tl.gather(y, tl.load(order_ptr + cols, mask=mask, other=0).to(tl.int32), 0)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             pdl: bool = False, order: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as Hugging Face's Llama computes it; with residual returns (normed, x + residual).
    order (int64 [hidden]): the normed output's columns in this order (normed[..., order]; the
    residual keeps its own), for a 4-bit projection whose groups are in activation order.
    pdl (here and in the other wrappers): launch with programmatic dependent launch (kernels/pdl.py)."""
    N = x.shape[-1]
    assert weight.shape == (N,) and weight.is_contiguous(), "weight must be [hidden] and contiguous"
    assert order is None or (order.shape == (N,) and order.dtype == torch.int64 and order.is_contiguous())
    assert x.dtype in _FLOAT_DTYPES and weight.dtype in _FLOAT_DTYPES
    x2 = x.reshape(-1, N)
    assert x2.stride(-1) == 1, "x's last dim must be contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, N)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = residual.reshape(-1, N)
        assert r2.stride(-1) == 1, "residual's last dim must be contiguous"
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ro2 = res_out.view(-1, N)
    else:
        r2 = ro2 = x2  # unused
        res_out = None
    rows = x2.shape[0]
    if rows:
        block = next_pow2(N)
        pdl = pdl and x.is_cuda
        launch(_rms_norm_kernel, (rows,),
            x2, r2, weight, weight if order is None else order, out2, ro2, eps,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), N,
            BLOCK=block, HAS_RES=residual is not None, ORDERED=order is not None, PDL=pdl,
            num_warps=min(16, max(1, block // 512)),
            launch_pdl=pdl,
        )
    return out if residual is None else (out, res_out)


@triton.jit
def rotary_row(cs_ptr, pos, stride_cs, dt: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(cos, sin) [HEAD_DIM] float32 for position pos, rounded to dt as torch rounds them, sin's
    first half negated: x rotated = x * cos + x[(d + HEAD_DIM / 2) % HEAD_DIM] * sin (rotate_half)."""
    d = tl.arange(0, HEAD_DIM)
    cs = cs_ptr + pos * stride_cs
    c = tl.load(cs + d).to(dt).to(tl.float32)
    s = tl.load(cs + HEAD_DIM + d).to(dt).to(tl.float32)
    return c, tl.where(d < HEAD_DIM // 2, -s, s)


@triton.jit
def rotate_rows(x, x_swapped, c, s):
    """Neox rotation of full heads [..., HEAD_DIM] with (cos, sin) from rotary_row, x_swapped the
    same heads with their halves swapped; each product and the sum rounded to x's dtype, as torch
    rounds q * cos + rotate_half(q) * sin. The kernel must be compiled with enable_fp_fusion=False
    (as _rotary_kernel is): else LLVM turns a product and the sum into one bf16/fp16 FMA (a single
    rounding), which on an H100 differed from torch by one unit in ~1 of 5 elements."""
    dt = x.dtype
    return ((x.to(tl.float32) * c).to(dt).to(tl.float32) + (x_swapped.to(tl.float32) * s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rotate_heads(ptr, t, stride_t, stride_h, n_heads, c, s, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rotate n_heads heads of token t in place -> the rotated heads [BLOCK_H, HEAD_DIM]."""
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    hmask = hh[:, None] < n_heads
    row = ptr + t * stride_t + hh[:, None] * stride_h
    x = tl.load(row + d[None, :], mask=hmask, other=0.0)
    xs = tl.load(row + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=hmask, other=0.0)
    tl.debug_barrier()  # in place: every thread has read both halves before any of them is overwritten
    o = rotate_rows(x, xs, c[None, :], s[None, :])
    tl.store(row + d[None, :], o, mask=hmask)
    return o


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # views at offsets of the step's inputs
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, HQ, HK,
                   stride_vt, stride_vh, stride_cb, stride_ch, stride_ct,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HEAD_DIM: tl.constexpr,
                   WRITE: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    c, s = rotary_row(cs_ptr, tl.load(pos_ptr + t).to(tl.int64), stride_cs, q_ptr.dtype.element_ty, HEAD_DIM)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, HQ, c, s, BLOCK_HQ, HEAD_DIM)
    k = _rotate_heads(k_ptr, t, stride_kt, stride_kh, HK, c, s, BLOCK_HK, HEAD_DIM)
    if WRITE:  # the rotated k and v into the pages (slot -1: a padded row, written nowhere)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            hh = tl.arange(0, BLOCK_HK)
            d = tl.arange(0, HEAD_DIM)
            hmask = hh[:, None] < HK
            cdt = kc_ptr.dtype.element_ty
            page = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + hh[:, None] * stride_ch + d[None, :]
            tl.store(kc_ptr + page, k.to(cdt), mask=hmask)
            pv = v_ptr + t * stride_vt + hh[:, None] * stride_vh + d[None, :]
            tl.store(vc_ptr + page, tl.load(pv, mask=hmask, other=0.0).to(cdt), mask=hmask)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding, IN PLACE on q [T, Hq, D] and k [T, Hkv, D]; returns (q, k).
    cos_sin [max_pos, 2, D] float32 (cos then sin, each duplicated over both halves).
    With v, k_cache, v_cache and slot_mapping: also writes the rotated k and v into those
    (unquantized) pages, as write_kv_cache does: one kernel instead of two per layer."""
    T, Hq, D = q.shape
    assert k.dim() == 3 and k.shape[0] == T and k.shape[2] == D and k.dtype == q.dtype
    assert D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0, "head_dim must be a power of two"
    assert q.stride(2) == 1 and k.stride(2) == 1, "q/k last dim must be contiguous"
    assert q.dtype in _FLOAT_DTYPES
    assert positions.shape == (T,) and not positions.dtype.is_floating_point
    assert cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, D) and cos_sin.dtype == torch.float32
    assert cos_sin.stride(2) == 1 and cos_sin.stride(1) == D
    write = k_cache is not None
    if write:
        assert v is not None and v_cache is not None and slot_mapping is not None
        assert v.shape == k.shape and v.stride(2) == 1 and v.dtype == k.dtype
        assert k_cache.shape[1] == k.shape[1] and k_cache.shape[3] == D and v_cache.shape == k_cache.shape
        assert k_cache.dtype in _FLOAT_DTYPES and v_cache.dtype == k_cache.dtype, "unquantized pages only"
        assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
        assert slot_mapping.shape == (T,) and not slot_mapping.dtype.is_floating_point
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, positions  # unused
    if T:
        Hk = k.shape[1]
        pdl = pdl and q.is_cuda
        launch(_rotary_kernel, (T,),
            q, k, positions, cos_sin, v, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0), Hq, Hk,
            v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_HQ=next_pow2(Hq), BLOCK_HK=next_pow2(Hk), HEAD_DIM=D,
            WRITE=write, BLOCK_SIZE=k_cache.shape[2] if write else 1, PDL=pdl, num_warps=4, launch_pdl=pdl,
            enable_fp_fusion=False,  # see rotate_rows
        )
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # torch rounds silu's result
    tl.store(out_ptr + row * stride_o + cols, (s * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [..., 2 * I] holding gate then up -> silu(gate) * up [..., I]."""
    N2 = x.shape[-1]
    assert N2 % 2 == 0 and x.dtype in _FLOAT_DTYPES
    N = N2 // 2
    x2 = x.reshape(-1, N2)
    assert x2.stride(-1) == 1, "x's last dim must be contiguous"
    out = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, N)
    if x2.shape[0] and N:
        block = min(1024, next_pow2(N))
        pdl = pdl and x.is_cuda
        launch(_silu_and_mul_kernel, (x2.shape[0], cdiv(N, block)),
            x2, o2, x2.stride(0), o2.stride(0), N, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


@triton.jit
def _gather_columns_kernel(x_ptr, order_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    src = tl.load(order_ptr + cols, mask=mask, other=0)  # no kernel writes the order: before the wait
    wait_for_prior(PDL)
    tl.store(out_ptr + row * stride_o + cols,
             tl.load(x_ptr + row * stride_x + src, mask=mask & (src >= 0), other=0.0), mask=mask)


def gather_columns(x: torch.Tensor, order: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x [M, K] -> x[:, order] [M, len(order)] (order int64; an entry of -1 gives a column of zeros):
    a 4-bit projection's input in its weight's activation order, where no kernel before it writes
    that order (kernels/int4.py)."""
    M, N = x.shape[0], order.shape[0]
    assert order.dim() == 1 and order.dtype == torch.int64 and x.stride(1) == 1
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        block = min(1024, next_pow2(N))
        pdl = pdl and x.is_cuda
        launch(_gather_columns_kernel, (M, cdiv(N, block)), x, order, out, x.stride(0), out.stride(0), N,
               BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
