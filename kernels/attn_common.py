"""@triton.jit helpers shared by the decode and prefill attention kernels, and their operands' checks."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcache.quant import v_page_shape

LOG2E = 1.4426950408889634
QUANT_CODE = {torch.float8_e4m3fn: 1, torch.int8: 2}  # 0: K/V stored in a float dtype


def check_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, shape: tuple[int, int, int]) -> None:
    """fp8/int8 scales: float32 [num_blocks, kv_heads, block_size], a page's tokens contiguous, K's
    and V's with the same strides (the kernels take one set), e.g. kvcache/quant.py's scale_views."""
    assert k_scale is not None and v_scale is not None, "fp8/int8 caches need k_scale and v_scale"
    assert k_scale.shape == shape and v_scale.shape == shape, f"scales must be {shape}"
    assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32, "scales must be float32"
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1, \
        "k_scale and v_scale need the same strides, tokens contiguous"


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                batch: int) -> None:
    """What the decode and prefill kernels ask of their operands: q [rows, q_heads, head_dim]
    (head_dim contiguous), K and V pages of one dtype (kvcache/quant.py's layouts), a head_dim and
    block size each a power of two, and a contiguous int32 block table of `batch` rows."""
    D, (_, Hkv, bs, Dc) = q.shape[2], k_cache.shape
    v_shape = v_page_shape(k_cache.shape, k_cache.dtype in QUANT_CODE)
    assert v_cache.shape == v_shape and v_cache.dtype == k_cache.dtype, "k/v caches differ"
    assert Dc == D and q.shape[1] % Hkv == 0, f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}"
    assert D & (D - 1) == 0 and 16 <= D <= 256, "head_dim must be a power of two in 16..256"
    assert bs & (bs - 1) == 0, "block_size must be a power of two"
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32) and q.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"


@triton.jit
def mma(a, b, NATIVE: tl.constexpr):
    """a @ b with float32 accumulation. NATIVE: 16-bit operands on the tensor cores. Otherwise the
    operands (already rounded to their 16- or 32-bit dtype) are multiplied in exact float32: for
    float32 models, and under Triton's CPU interpreter, whose bf16 dot is wrong (it multiplies the
    raw uint16 bit patterns)."""
    if NATIVE:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def kv_to_dot(x, dot_ty: tl.constexpr, QUANT: tl.constexpr):
    """Convert a loaded K/V tile to the product dtype. Quantized tiles go to float16 when
    dot_ty is 16-bit: fp8 e4m3 -> fp16 is one packed instruction on Hopper, and int8 -> fp16 is
    done with integer ops (bits 0x6400 | (x + 128) hold 1024 + x + 128 exactly) instead of the
    slow int -> float conversion unit."""
    if QUANT == 2:
        if dot_ty == tl.float32:
            return x.to(tl.float32)
        else:
            h = (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True)
            return h - 1152.0
    elif QUANT == 1:
        if dot_ty == tl.float32:
            return x.to(tl.float32)
        else:
            return x.to(tl.float16)
    else:
        return x.to(dot_ty)
