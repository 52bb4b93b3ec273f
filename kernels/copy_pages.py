"""Copy whole KV pages between two pools by block id, in one pass: dst[g, dst_blocks[i]] =
src[g, src_blocks[i]] for every group g (a layer's K or V pages, or its scales) and listed block i.

Disaggregation's pull (engine/kv_transfer.py): src is a prefill engine's pool mapped into the
decode engine's process, so every load crosses the GPUs' peer link. One program per (block,
group, chunk of a page), each moving a chunk of 8-byte words: thousands of programs keep enough
loads in flight to fill the link, where torch's index_select then index_copy_ made two passes
(one of them over the link) through a temporary (bench/NOTES.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch

CHUNK = 1024  # words a program moves


@triton.jit
def _copy_pages_kernel(src, dst, src_blocks, dst_blocks, words, src_group_stride, dst_group_stride,
                       CHUNK: tl.constexpr):
    i = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    sb = tl.load(src_blocks + i).to(tl.int64)
    db = tl.load(dst_blocks + i).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words
    x = tl.load(src + g * src_group_stride + sb * words + offs, mask=mask)
    tl.store(dst + g * dst_group_stride + db * words + offs, x, mask=mask)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    """src [groups, src_num_blocks, words] and dst [groups, dst_num_blocks, words], contiguous, of
    one dtype; src_blocks and dst_blocks: int32/int64 block ids of equal length, on dst's device."""
    if src.dim() != 3 or dst.dim() != 3 or src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
        raise ValueError(f"pages of other shapes: {tuple(src.shape)} into {tuple(dst.shape)}")
    if src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_pages takes contiguous pages of one dtype")
    if src_blocks.shape != dst_blocks.shape or src_blocks.dim() != 1:
        raise ValueError("one source block per destination block")
    n, (groups, _, words) = src_blocks.numel(), src.shape
    if n == 0:
        return
    grid = (n, groups, triton.cdiv(words, CHUNK))
    launch(_copy_pages_kernel, grid, src, dst, src_blocks, dst_blocks, words, src.stride(0), dst.stride(0),
           CHUNK=CHUNK, num_warps=4)
