"""A decode graph's inputs from one uploaded buffer: the first kernel of every decode CUDA graph.

The runner writes a decode step's inputs into a pinned host buffer and copies it to the device in
one transfer; inside the graph this kernel spreads it into the graph's static inputs. Before it,
every replay cost the host a torch call per input (copies, fills, the pending tokens' gather):
~0.2-0.4 ms of a Qwen2.5-0.5B decode step's host time on the H100 machine (bench/NOTES.md).

The uploaded buffer, int64 words and then, from int64 word 2 + 3n on, int32 words:
    int64 [n, width, ids (n), positions (n), pending rows (n)] then int32 [tables (n x width)]
A row whose pending row p >= 0 takes its input token from `tokens[p]`, the previous step's sampled
tokens, still on the device. Rows n.. of the graph's bucket are padding: position 0, slot -1
(written nowhere), one token of context.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch, next_pow2


@triton.jit
def _unpack_kernel(s64_ptr, s32_ptr, tokens_ptr, ids_ptr, pos_ptr, slot_ptr, sl_ptr, bt_ptr, stride_bt,
                   BLOCK_SIZE: tl.constexpr, BLOCK_W: tl.constexpr):
    i = tl.program_id(0)
    n = tl.load(s64_ptr).to(tl.int32)
    if i < n:
        width = tl.load(s64_ptr + 1).to(tl.int32)
        tok = tl.load(s64_ptr + 2 + i)
        pos = tl.load(s64_ptr + 2 + n + i)
        pend = tl.load(s64_ptr + 2 + 2 * n + i)
        if pend >= 0:
            tok = tl.load(tokens_ptr + pend)
        src = s32_ptr + 2 * (2 + 3 * n) + i.to(tl.int64) * width
        dst = bt_ptr + i.to(tl.int64) * stride_bt
        for c in range(0, width, BLOCK_W):
            cols = c + tl.arange(0, BLOCK_W)
            m = cols < width
            tl.store(dst + cols, tl.load(src + cols, mask=m, other=0), mask=m)
        blk = tl.load(src + pos // BLOCK_SIZE).to(tl.int64)
        tl.store(ids_ptr + i, tok)
        tl.store(pos_ptr + i, pos)
        tl.store(slot_ptr + i, blk * BLOCK_SIZE + pos % BLOCK_SIZE)
        tl.store(sl_ptr + i, (pos + 1).to(tl.int32))
    else:
        tl.store(ids_ptr + i, 0)
        tl.store(pos_ptr + i, 0)
        tl.store(slot_ptr + i, -1)
        tl.store(sl_ptr + i, 1)


def unpack(stage: torch.Tensor, tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
           slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> None:
    """Fill the first B = input_ids.shape[0] rows of the static inputs from `stage` (int64, the
    layout above; its n <= B). tokens [>= max pending row + 1] int64."""
    B = input_ids.shape[0]
    assert stage.dtype == torch.int64 and stage.is_contiguous() and tokens.dtype == torch.int64
    assert positions.shape == slot_mapping.shape == seq_lens.shape == (B,) and block_tables.shape[0] >= B
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 and seq_lens.dtype == torch.int32
    launch(_unpack_kernel, (B,), stage, stage.view(torch.int32), tokens, input_ids, positions, slot_mapping,
           seq_lens, block_tables, block_tables.stride(0),
           BLOCK_SIZE=block_size, BLOCK_W=min(256, next_pow2(block_tables.shape[1])), num_warps=1)


def unpack_reference(stage: torch.Tensor, tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     block_size: int) -> None:
    """unpack() in plain torch (the tests' oracle)."""
    n, width = int(stage[0]), int(stage[1])
    ids, pos, pend = stage[2:2 + n], stage[2 + n:2 + 2 * n], stage[2 + 2 * n:2 + 3 * n]
    head32 = 2 * (2 + 3 * n)
    tables = stage.view(torch.int32)[head32:head32 + n * width].view(n, width)
    ids = torch.where(pend >= 0, tokens[pend.clamp_min(0)], ids)
    block_tables[:n, :width] = tables
    input_ids[:n], positions[:n] = ids, pos
    slot_mapping[:n] = tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).long() * block_size + pos % block_size
    seq_lens[:n] = (pos + 1).int()
    input_ids[n:], positions[n:], slot_mapping[n:], seq_lens[n:] = 0, 0, -1, 1
