"""Reference quantization of KV entries, and the scale convention.

Convention: one float32 scale per (token, KV head) for K and one for V, computed when the token
is written ("dynamic" scales); stored value q = x / scale, rounded to the storage type (fp8 e4m3:
round half to even; int8: round half to even, clamped to +-127: -128 is never produced);
dequantize with x ~= q * scale. The base scale is max(|x|) / QMAX over the head's head_dim values
(1 when the head is all zeros), QMAX = 448 for fp8 e4m3 (its largest finite value), 127 for int8.

V, and K when no queries are given, use the base scale. K (the rotated key k @ R, see
kvcache/rotation.py) is written with the queries of the same token (q @ R, the G = Hq / Hkv
query heads that read this KV head) and takes one of NUM_CANDIDATES scales

    scale_j = base * (1 + j * STEP),   j = 0 .. NUM_CANDIDATES - 1

(1 + j * STEP is exact in float32; candidate 0 is the base scale. STEP = 1/16 for fp8: the
candidates cover an octave, over which e4m3's grid repeats; 1/128 for int8, whose grid is
uniform, so that small moves realign it) -- the one whose rounding changes the token's own
attention scores least:

    err_j = sum over g of (sum over d of qr[g, d] * (code_j[d] * scale_j - k[d]))**2

(the smallest j on ties). The error of a stored key only matters along the directions queries
look in, and the queries of one KV head share their large directions (the same few RoPE channel
pairs carry most of their energy), so the token's own queries stand in for the later ones that
will read the key. Nothing is calibrated and nothing new is stored: the choice is a function of
that token's q and k alone, the same however the prefix is batched or cached; attention reads
code * scale as before. On SmolLM2-135M (`serve kv-calc --accuracy`) it cut the mean KL of fp8
against the bf16 cache from 3.4e-3 to 1.6e-3 (int8: 2.3e-4 to 1.4e-4).

The candidates' codes are computed as x * (1 / scale_j); the final codes of the chosen scale as
x / scale, like V's. The Triton cache-write kernel sums err_j in its own order (and may fuse
multiply-adds), so where two candidates' errors agree to float32 rounding it may pick the other
one: a scale whose error is the least up to that rounding is what both paths guarantee, and the
codes are always the rounding of x at the scale stored (tests/kernels/test_cache_write.py).

Page layout: fp8/int8 caches store V pages transposed, [num_blocks, kv_heads, head_dim,
block_size]: one dim's values of a page's tokens are contiguous. The tensor cores take the
tokens of P @ V in pairs per register; with 8-bit values stored token-major the decode kernel
assembled them byte by byte from shared memory (a third of its instructions on an H100,
bench/KERNELS.md). K pages and float caches keep [.., block_size, head_dim].

Scales: K's and V's of a page and KV head sit side by side, one [num_blocks, kv_heads, 2,
block_size] float32 tensor (new_scales); kernels take K's and V's as the two strided views
[num_blocks, kv_heads, block_size]. A page's scales are then one contiguous run (128 bytes at
block size 16, 256 at 32) instead of two far apart: ~2% faster decode (bench/KERNELS.md).
"""
from __future__ import annotations

import torch

QMAX = {"fp8": 448.0, "int8": 127.0}
STORAGE_TORCH_DTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
NUM_CANDIDATES = 8  # K scales tried per (token, KV head): fp8 top-1 and the H100 write cost in bench/NOTES.md
STEP = {"fp8": 1.0 / 16, "int8": 1.0 / 128}  # candidate j multiplies the base scale by 1 + j * STEP


def scale_factors(kv_dtype: str, n: int = NUM_CANDIDATES) -> list[float]:
    """1 + j * STEP for j < n: exact float32 values (as Python floats)."""
    return [1.0 + j * STEP[kv_dtype] for j in range(n)]


def v_page_shape(k_shape: tuple[int, ...], quantized: bool) -> tuple[int, ...]:
    """The V pages' shape for K pages of k_shape [num_blocks, kv_heads, block_size, head_dim]."""
    nb, h, bs, d = k_shape
    return (nb, h, d, bs) if quantized else (nb, h, bs, d)


def v_page_view(v_cache: torch.Tensor) -> torch.Tensor:
    """A quantized cache's V pages [num_blocks, kv_heads, head_dim, block_size] seen as
    [num_blocks, kv_heads, block_size, head_dim] (a view: writes go to the pages)."""
    return v_cache.transpose(-1, -2)


def scales_shape(num_blocks: int, kv_heads: int, block_size: int, leading: tuple[int, ...] = ()) -> tuple[int, ...]:
    return (*leading, num_blocks, kv_heads, 2, block_size)


def new_scales(num_blocks: int, kv_heads: int, block_size: int, device: torch.device | str,
               leading: tuple[int, ...] = ()) -> torch.Tensor:
    """Scales [*leading, num_blocks, kv_heads, 2, block_size], all 1: split with scale_views."""
    return torch.ones(scales_shape(num_blocks, kv_heads, block_size, leading), dtype=torch.float32, device=device)


def scale_views(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K's and V's scales [.., num_blocks, kv_heads, block_size] of a new_scales() tensor (views)."""
    return scales[..., 0, :], scales[..., 1, :]


def paired_scales(k_scale: torch.Tensor, v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of separate K and V scales [.., num_blocks, kv_heads, block_size] in new_scales' layout."""
    *leading, nb, h, bs = k_scale.shape
    k, v = scale_views(new_scales(nb, h, bs, k_scale.device, tuple(leading)))
    return k.copy_(k_scale), v.copy_(v_scale)


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """torch dtype of the pages for a KV storage dtype name."""
    if kv_dtype in STORAGE_TORCH_DTYPE:
        return STORAGE_TORCH_DTYPE[kv_dtype]
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[kv_dtype]


def _round(y: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """y (float32) -> the stored values, clamped to +-QMAX and rounded, as float32."""
    qmax = QMAX[kv_dtype]
    if kv_dtype == "int8":
        return torch.round(y).clamp(-qmax, qmax)
    return y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).float()


def base_scale(xf: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """max(|x|) / QMAX over the last dim (1 where the head is all zeros), float32."""
    amax = xf.abs().amax(dim=-1)
    return torch.where(amax > 0, amax / QMAX[kv_dtype], torch.ones_like(amax))


def candidates(xf: torch.Tensor, base: torch.Tensor, kv_dtype: str,
               num_candidates: int = NUM_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """K's candidate scales [..., N] from the base scale [...], and xf's codes [..., N, D] at each
    (as float32 values, rounded from x * (1 / scale))."""
    # 1 + j * STEP on the device (no host copy): j * STEP and the sum are exact in float32
    f = 1.0 + torch.arange(num_candidates, dtype=torch.float32, device=xf.device) * STEP[kv_dtype]
    scales = base.unsqueeze(-1) * f
    return scales, _round(xf.unsqueeze(-2) * (1.0 / scales).unsqueeze(-1), kv_dtype)


def score_errors(xf: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qf: torch.Tensor) -> torch.Tensor:
    """err_j for candidates: xf [..., D], codes [..., N, D], scales [..., N], qf [..., G, D] -> [..., N]."""
    e = codes * scales.unsqueeze(-1) - xf.unsqueeze(-2)  # [..., N, D]
    return (e @ qf.transpose(-1, -2)).square().sum(-1)  # [..., N, G] -> [..., N]


def quantize(x: torch.Tensor, kv_dtype: str, q: torch.Tensor | None = None,
             num_candidates: int = NUM_CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q [..., head_dim] in storage dtype, scale [...] float32).

    q: the same token's queries that read x, [..., G, head_dim] (x's leading dims): the scale is
    then the candidate that changes their scores least (module docstring); None: the base scale."""
    xf = x.float()
    base = base_scale(xf, kv_dtype)
    if q is None or num_candidates == 1:
        scale = base
    else:
        assert q.shape[:-2] == x.shape[:-1] and q.shape[-1] == x.shape[-1], (q.shape, x.shape)
        scales, codes = candidates(xf, base, kv_dtype, num_candidates)
        best = score_errors(xf, codes, scales, q.float()).argmin(dim=-1, keepdim=True)  # first of equal minima
        scale = scales.gather(-1, best).squeeze(-1)
    y = _round(xf / scale.unsqueeze(-1), kv_dtype)
    return y.to(STORAGE_TORCH_DTYPE[kv_dtype]), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(out_dtype)
