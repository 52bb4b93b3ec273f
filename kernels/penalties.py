"""The repetition, frequency and presence penalties of sampling rows in one pass over their logits
(engine/logit_adjust.py), in place: a row's sequence keeps its output-token counts and its prompt's
tokens as rows of two [slots, V] buffers on the device, read here by slot. In torch the same takes
about ten launches over [rows, V] (gathers, compares, two wheres, products), each paid by the host
of a small model's decode step.

Rounds as the torch path does (reference.penalize_rows): a positive logit of a token seen in the
prompt or output is divided by the repetition penalty, a negative one multiplied; then
frequency x count and presence x (count > 0) are subtracted, each product rounded before its
subtraction (no fused multiply-add).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch

BLOCK = 2048
CHUNK = 8192  # logits a program covers: 64 rows of 49,152 make 384 programs


# the row lists are slices of one upload (engine/logit_adjust.py): any alignment, one compile
@triton.jit(do_not_specialize_on_alignment=["rows_ptr", "slots_ptr", "params_ptr"])
def _penalize_kernel(x_ptr, x_stride, rows_ptr, slots_ptr, params_ptr, counts_ptr, prompt_ptr, buf_stride, V,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    slot = tl.load(slots_ptr + r)
    rep = tl.load(params_ptr + 3 * r)
    freq = tl.load(params_ptr + 3 * r + 1)
    pres = tl.load(params_ptr + 3 * r + 2)
    x_row = x_ptr + row * x_stride
    c_row = counts_ptr + slot * buf_stride
    p_row = prompt_ptr + slot * buf_stride
    for start in range(0, CHUNK, BLOCK):
        offs = tl.program_id(1) * CHUNK + start + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(x_row + offs, mask=m, other=0.0)
        c = tl.load(c_row + offs, mask=m, other=0.0)
        seen = (c > 0) | (tl.load(p_row + offs, mask=m, other=0) != 0)
        y = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
        y = y - freq * c
        y = y - tl.where(c > 0, pres, 0.0)
        tl.store(x_row + offs, y, mask=m)


def penalize_rows(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, params: torch.Tensor,
                  counts: torch.Tensor, prompt: torch.Tensor) -> None:
    """In place: x [N, V] float32 logits; for each i, row rows[i] (int64) takes the penalties
    params[i] = (repetition, frequency, presence) (float32 [R, 3]) against counts[slots[i]] (float32
    [S, V], output-token counts) and prompt[slots[i]] (bool [S, V], the prompt's tokens)."""
    assert x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1
    r = rows.numel()
    V = x.shape[1]
    assert rows.dtype == slots.dtype == torch.int64 and slots.numel() == r and rows.is_contiguous()
    assert slots.is_contiguous() and params.shape == (r, 3) and params.dtype == torch.float32
    assert params.is_contiguous()
    assert counts.dtype == torch.float32 and prompt.dtype == torch.bool and counts.shape == prompt.shape
    assert counts.shape[1] == V and counts.is_contiguous() and prompt.is_contiguous()
    if not r:
        return
    launch(_penalize_kernel, (r, triton.cdiv(V, CHUNK)), x, x.stride(0), rows, slots, params, counts,
           prompt.view(torch.uint8), counts.stride(0), V, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
