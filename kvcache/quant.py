"""Reference quantization of KV entries, and the scale convention.

Convention: one float32 scale per (token, KV head) for K and one for V, computed when the token
is written ("dynamic" scales): scale = max(|x|) / QMAX over the head's head_dim values (1 when the
head is all zeros), stored value q = x / scale, rounded to the storage type; dequantize with
x ~= q * scale. QMAX is 448 for fp8 e4m3 (its largest finite value) and 127 for int8 (symmetric:
-128 is never produced). The Triton cache-write kernel implements exactly this; tests compare.
What an fp8/int8 cache stores as K is the rotated key k @ R (kvcache/rotation.py), quantized so.
"""
from __future__ import annotations

import torch

QMAX = {"fp8": 448.0, "int8": 127.0}
STORAGE_TORCH_DTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """torch dtype of the pages for a KV storage dtype name."""
    if kv_dtype in STORAGE_TORCH_DTYPE:
        return STORAGE_TORCH_DTYPE[kv_dtype]
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[kv_dtype]


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q [..., head_dim] in storage dtype, scale [...] float32)."""
    qmax = QMAX[kv_dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = xf / scale.unsqueeze(-1)
    if kv_dtype == "int8":
        q = torch.round(y).clamp(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(out_dtype)
