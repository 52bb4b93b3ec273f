"""4-bit checkpoints into the engine's layout, and 4-bit quantization of 16-bit weights.

The engine holds a 4-bit projection [N, K] (engine/quant.py Int4Format) as
- weight: int32 [N, K/8], eight values a word along K. Within each block of B = 128 columns (or the
  largest power of two dividing K), word c's nibble j holds column j * B/8 + c: each nibble
  position of a block's 16 words is 16 consecutive columns, one MMA's K (kernels/int4.py);
- weight_scale: float16 [K/G, N], one scale per group of G input columns and output row;
- weight_zero: uint8 [K/G, N], the zero point of the same group (8 for symmetric checkpoints);
so that w[n, k] = (q[n, k] - zero[k // G, n]) * scale[k // G, n]. Every checkpoint layout below is
turned into column order, [N, ...], tensor by tensor; the loader cuts the rank's part and packs it
(engine/loader.py).
"""
from __future__ import annotations

import torch

from engine.quant import INT4_PACK, Int4Format
from kernels.reference import INT4_SHIFTS as SHIFTS
from kernels.reference import int4_block, int4_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column AWQ packs in each successive nibble of a word


def pack(values: torch.Tensor) -> torch.Tensor:
    """uint8 values of 0-15 [R, K] in column order -> the engine's words int32 [R, K/8], unpack's inverse."""
    R, K = values.shape
    B = int4_block(K)
    v = values.to(torch.int32).reshape(R, K // B, INT4_PACK, B // INT4_PACK).transpose(2, 3)
    v = v.reshape(R, K // INT4_PACK, INT4_PACK) << SHIFTS.to(values.device)
    out = v[..., 0].clone()  # the nibbles do not overlap: OR them (the top one wraps into the sign bit)
    for i in range(1, INT4_PACK):
        out |= v[..., i]
    return out


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, C/8] words packed along C in AWQ_ORDER -> uint8 [R, C] in column order."""
    vals = int4_nibbles(packed).reshape(packed.shape[0], -1, INT4_PACK)
    order = torch.tensor(AWQ_ORDER, device=packed.device).argsort()  # nibble that holds column j
    return vals[..., order].reshape(packed.shape[0], -1)


def to_engine(fmt: Int4Format, kind: int, src: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor of one projection -> its values in column order, [N, ...], for the loader
    to cut and store (pack the values; the others transposed). kind: its place in fmt.tensor_names()
    (0 packed values -> uint8 [N, K]; 1 scales -> float16 [N, K/G]; 2 zero points -> uint8 [N, K/G])."""
    if fmt.method == "compressed-tensors":
        return int4_nibbles(src) if kind == 0 else src.to(torch.float16)
    if kind == 1:
        return src.t().to(torch.float16)
    if fmt.method == "awq":
        return _awq_columns(src).t()
    if kind == 0:  # GPTQ's words run along K: [K/8, N] -> [N, K]
        return int4_nibbles(src.t().contiguous())
    zeros = int4_nibbles(src)
    if fmt.zero_minus_one:
        zeros = zeros + 1  # 15 + 1 = 16: GPTQ v1's zero point 0, which uint8 holds
    return zeros.t()


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 16/32-bit weight [N, K] -> (int32 [N, K/8], float16 scales, uint8 zeros [K/G, N]): each
    group's values rounded to the nearest of 16 levels spread over its range (min to max, zero
    exact), as AWQ and asymmetric GPTQ quantize. group -1: one group a row."""
    N, K = w.shape
    g = K if group == -1 else group
    wf = w.float().reshape(N, K // g, g)
    lo = wf.amin(dim=-1).clamp(max=0.0)
    hi = wf.amax(dim=-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).to(torch.float16)
    s = scale.float()
    zero = (-lo / s).round().clamp(0, 15)
    q = (wf / s[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    return pack(q), scale.t().contiguous(), zero.to(torch.uint8).t().contiguous()
