"""@triton.jit helpers shared by the decode and prefill attention kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
