"""The fused mixture-of-experts layer: tokens sorted by expert, two grouped matmuls, a sum.

1. align (three small kernels, no host sync): the T*k (token, expert) assignments are sorted by
   expert and each expert's run padded to a multiple of BLOCK_M; sorted_ids[r] names the
   assignment of row r (T*k: a padding row), block_expert[b] the expert of rows b*BLOCK_M.. (-1:
   past the last expert's rows; another rank's experts get none). The buffers have the worst
   case's size, which the shapes alone fix (T*k // BLOCK_M + min(E, T*k) blocks), so CUDA graphs
   can capture it.
2. gate/up kernel: a program takes one block of rows (one expert) and BLOCK_N columns of I, gathers
   the rows' tokens from x and keeps the gate and up accumulators, SiLU and multiply in the
   epilogue -> act [rows, I] in sorted order.
3. down kernel: act @ w2[e].T, times each row's routing weight (float32), written to the row's
   assignment: rows [T*k, H]; then a small kernel sums each token's k rows in float32.

Decode (a few rows per expert) reads each touched expert's weights once, in BLOCK_M = 16 blocks
(the smallest tl.dot): memory bound. Prefill takes larger tiles: compute bound. plan() picks from
the mean rows per expert (PLAN_TABLE). A Plan's options beside the tiles (program order, gate and
up as one dot, TMA descriptors, the down kernel's own tiles) are there for lab/moe_gpu.py --sweep
to measure.

Rounding as kernels/moe_reference.py (the reference and the CPU path).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.attn_common import mma
from kernels.launch import TensorDescriptor, cdiv, launch, next_pow2, sm_count


@dataclass(frozen=True)
class Tiles:
    """One grouped matmul's launch beside the row tile (BLOCK_M, which align() fixes for both)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # program order. 0: every row block of column tile 0, then of tile 1, ... (an expert's row
    # blocks run side by side and share its weight tile through L2). g > 0: g row blocks at a time,
    # each group over every column tile before the next (they also share their x rows)
    group_m: int = 0
    # weights (and the down kernel's act rows) through TMA descriptors, where the strides allow
    # (16-byte aligned rows, experts stacked contiguously); else pointer loads. x's rows are gathered
    # by token, so the gate/up kernel loads them with pointers either way
    tma: bool = False
    # one program an SM over all tiles instead of one a tile (see _moe_gate_up_kernel)
    persistent: bool = False


@dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 0  # the gate/up kernel's Tiles.group_m
    tma: bool = False  # the gate/up kernel's Tiles.tma
    # gate and up in one dot over 2 * BLOCK_N columns of w13 (one accumulator; the SiLU's pairs
    # split apart in the epilogue) instead of two dots of BLOCK_N
    fuse_gate_up: bool = False
    down: Tiles | None = None  # the down kernel's launch; None: the gate/up kernel's
    persistent: bool = False  # the gate/up kernel's Tiles.persistent

    def gate_up_tiles(self) -> Tiles:
        return Tiles(self.block_n, self.block_k, self.num_warps, self.num_stages, self.group_m, self.tma,
                     self.persistent)

    def down_tiles(self) -> Tiles:
        return self.down or self.gate_up_tiles()


# (most rows an expert, Plan): plan() takes the first entry whose bound holds for the mean rows an
# expert gets (T*k / E); the last bound is math.inf. Each expert's run is padded to BLOCK_M, so
# bigger row tiles waste more of a run (E x BLOCK_M / 2 rows on average) until the runs are long.
# Measured on an H100 at Qwen3-30B-A3B's shape (lab/moe_gpu.py): at 4 rows an expert (64 tokens)
# 16 x 64 x 128 tiles read the experts at 95% of the copy bandwidth; from 512 tokens
# `lab/moe_gpu.py --sweep`'s winners per size (weights through TMA, gate and up in one dot, the down
# kernel's own tiles): 512 tokens 461 us, 1,024 494 us (64-row tiles; 2026-11-26,
# bench/results/moe-sweep-h100-2026-11-26-c.json); from 2,048 tokens the down kernel persistent,
# from 4,096 the gate/up kernel too below 16,384 (2026-11-27, bench/results/moe-sweep-h100-2026-11-27.json,
# the table before in the same run): 2,048 577 us (580), 4,096 782 us (811, 50% of the matmul
# rate), 8,192 1,294 us (1,392; 60%), 16,384 2,443 us (2,604; 64%). From 2,048 tokens the two
# matmuls stream their operands through L2 at ~8 TB/s, 83-85% of its peak (ncu, 8,192 tokens):
# 128 x 256 tiles are the most a block's registers hold, and a larger share of the matmul rate
# needs operands shared between blocks (TMA multicast). `--sweep` prints a table in this form.
PLAN_TABLE: tuple[tuple[float, Plan], ...] = (
    (16, Plan(16, 64, 128, 4, 4)),
    (45, Plan(64, 64, 128, 4, 4, group_m=1, tma=True, fuse_gate_up=True,
              down=Tiles(128, 64, 4, 4, group_m=2, tma=True))),
    (91, Plan(64, 64, 128, 4, 4, group_m=2, tma=True, fuse_gate_up=True,
              down=Tiles(128, 64, 4, 4, group_m=1, tma=True))),
    (181, Plan(128, 128, 64, 8, 4, group_m=4, tma=True, fuse_gate_up=True,
               down=Tiles(256, 64, 8, 4, group_m=1, tma=True, persistent=True))),
    (362, Plan(128, 128, 64, 8, 4, group_m=4, tma=True, fuse_gate_up=True, persistent=True,
               down=Tiles(256, 64, 8, 4, group_m=4, tma=True, persistent=True))),
    (724, Plan(128, 128, 64, 8, 4, group_m=4, tma=True, fuse_gate_up=True, persistent=True,
               down=Tiles(256, 64, 8, 4, group_m=1, tma=True, persistent=True))),
    (math.inf, Plan(128, 128, 64, 8, 4, group_m=4, tma=True, fuse_gate_up=True,
                    down=Tiles(256, 64, 8, 4, group_m=4, tma=True, persistent=True))),
)


def plan(tokens: int, top_k: int, num_experts: int,
         table: tuple[tuple[float, Plan], ...] = PLAN_TABLE, itemsize: int = 2) -> Plan:
    """The tiles for the mean rows an expert gets (T*k / E), from `table` (see PLAN_TABLE), whose
    tiles are sized for 16-bit values; for wider ones (float32) each K step is cut to keep the
    stages' shared memory the same (the table's largest plans would need 352 KiB of an H100's 227)."""
    rows = tokens * top_k / max(1, num_experts)
    p = next(p for bound, p in table if rows <= bound)
    if itemsize <= 2:
        return p
    scale = itemsize // 2
    down = p.down_tiles()
    return replace(p, block_k=max(16, p.block_k // scale),
                   down=replace(down, block_k=max(16, down.block_k // scale)))


def max_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """The most row blocks `assignments` rows over num_experts padded runs can take."""
    return assignments // block_m + min(num_experts, assignments)


def align(topk_ids: torch.Tensor, num_experts: int, expert_start: int,
          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 -> (sorted_ids int32 [blocks * block_m], block_expert int32 [blocks]),
    see the module's docstring; three kernels, each over many programs (counts by atomics, then
    each expert's first row and each block's expert, then each assignment's row by an atomic add:
    the order of rows within an expert's run varies, which changes no row's result). Experts
    outside [expert_start, expert_start + num_experts) get no rows."""
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous(), "topk_ids must be contiguous int32"
    n = topk_ids.numel()
    blocks = max_blocks(n, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    e_pad = next_pow2(num_experts + 1)  # the last bin collects other ranks' experts
    counts = torch.zeros(e_pad, dtype=torch.int32, device=dev)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)
    chunk, blocks_chunk = 1024, max(16, 8192 // e_pad)
    launch(_align_counts_kernel, (cdiv(max(n, blocks * block_m, 1), chunk),), topk_ids, counts, sorted_ids, n,
           blocks * block_m, expert_start, num_experts, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    launch(_align_blocks_kernel, (cdiv(max(blocks, 1), blocks_chunk),), counts, cursor, block_expert, blocks,
           num_experts, BLOCK_M=block_m, E_PAD=e_pad, BLOCKS_CHUNK=blocks_chunk, num_warps=4)
    launch(_align_scatter_kernel, (cdiv(n, chunk),), topk_ids, cursor, sorted_ids, n, blocks * block_m,
           expert_start, num_experts, CHUNK=chunk, num_warps=4)
    return sorted_ids, block_expert


# Align and the sum took 0.11 ms beside the two matmuls at 4,096 tokens on an H100
# (bench/results/moe-kernel-2026-11-26.json) when one program counted every assignment in a loop
# (T*k / 1024 steps): the counts now spread over a program per 1,024 rows.
@triton.jit(do_not_specialize=["n", "num_rows"])
def _align_counts_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, n, num_rows, expert_start, num_experts,
                         E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    # a chunk of assignments added to each expert's count (zeroed before), and a chunk of rows
    # marked padding (n) until the scatter fills them
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < n
    e = tl.load(ids_ptr + offs, mask=ok, other=0) - expert_start
    e = tl.where(ok & (e >= 0) & (e < num_experts), e, E_PAD - 1)
    hist = tl.histogram(e, E_PAD)
    lanes = tl.arange(0, E_PAD)
    tl.atomic_add(counts_ptr + lanes, hist, mask=(lanes < num_experts) & (hist > 0))
    tl.store(sorted_ids_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n, mask=offs < num_rows)


@triton.jit(do_not_specialize=["num_blocks"])
def _align_blocks_kernel(counts_ptr, cursor_ptr, block_expert_ptr, num_blocks, num_experts, BLOCK_M: tl.constexpr,
                         E_PAD: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    # each expert's count padded to BLOCK_M; program 0 writes each expert's first row (the
    # scatter's cursor), every program the expert of its chunk of blocks
    lanes = tl.arange(0, E_PAD)
    mine = lanes < num_experts
    padded = (tl.load(counts_ptr + lanes, mask=mine, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + lanes, ends - padded)
    b = tl.program_id(0) * BLOCKS_CHUNK + tl.arange(0, BLOCKS_CHUNK)
    before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & mine[None, :]
    expert = tl.sum(before.to(tl.int32), axis=1)  # experts whose rows end before the block
    tl.store(block_expert_ptr + b, tl.where(expert < num_experts, expert, -1), mask=b < num_blocks)


@triton.jit(do_not_specialize=["n", "num_rows"])
def _align_scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, n, num_rows, expert_start, num_experts,
                          CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=0) - expert_start
    ok = (offs < n) & (e >= 0) & (e < num_experts)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
    # the bound holds by construction; it keeps a dry pass (counts not run, kernels/launch.py
    # compile_ahead) from writing out of bounds
    tl.store(sorted_ids_ptr + row, offs, mask=ok & (row >= 0) & (row < num_rows))


@triton.jit
def _tile(pid, num_blocks, num_n, GROUP_M: tl.constexpr):
    """Program pid's (row block, column tile), in Tiles.group_m's order."""
    if GROUP_M == 0:
        pid_m = pid % num_blocks
        pid_n = pid // num_blocks
    else:
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size
        pid_n = (pid % per_group) // size
    return pid_m, pid_n


@triton.jit
def _used_blocks(block_expert_ptr, num_blocks):
    """The row blocks that have an expert: align() puts the blocks without one (-1) last."""
    used = 0
    for b0 in range(0, num_blocks, 1024):
        b = b0 + tl.arange(0, 1024)
        used += tl.sum((tl.load(block_expert_ptr + b, mask=b < num_blocks, other=-1) >= 0).to(tl.int32))
    return used


@triton.jit
def _block_expert(block_expert_ptr, pid_m, num_experts):
    # a persistent program's blocks all have an expert, except in a dry pass (kernels/launch.py
    # compile_ahead: align not run), where any value keeps the loads in bounds
    e = tl.load(block_expert_ptr + pid_m)
    return tl.where((e >= 0) & (e < num_experts), e, 0)


# Persistent launches (Tiles.persistent): one program per SM walks the tiles of the used row blocks,
# the tile loop flattened with the K loop so that the next tile's loads are in flight during this
# tile's epilogue (a 128 x 256 tile's 4 stages fill 192 KiB of shared memory: one program an SM, so
# nothing else hides its prologue and epilogue). The epilogue recomputes its tile from its own
# counter instead of carrying the loop's values (as Triton's persistent matmul tutorial does).
# The token count varies every step: no specialization on it (no compiles mid-serving). The checks
# of e and ids cost nothing and keep a dry pass (kernels/launch.py compile_ahead: align not run)
# from reading out of bounds.
@triton.jit(do_not_specialize=["n", "num_blocks"])
def _moe_gate_up_kernel(x_ptr, w, out_ptr, sorted_ids_ptr, block_expert_ptr, n, num_blocks, num_experts, H, I,
                        stride_xm, stride_we, stride_wn, stride_om,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FUSED: tl.constexpr, W_TMA: tl.constexpr,
                        PERSISTENT: tl.constexpr, NATIVE: tl.constexpr):
    # w: w13's pointer, or with W_TMA its descriptor: [E * 2I, H] rows, or [E * 2, I, H] when FUSED
    num_n = tl.cdiv(I, BLOCK_N)
    if PERSISTENT:
        used = _used_blocks(block_expert_ptr, num_blocks)
        tile_c = tl.program_id(0) - tl.num_programs(0)
        for tile in tl.range(tl.program_id(0), used * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _tile(tile, used, num_n, GROUP_M)
            e = _block_expert(block_expert_ptr, pid_m, num_experts)
            acc_g, acc_u = _gate_up_acc(x_ptr, w, sorted_ids_ptr, e, pid_m, pid_n, n, H, I, stride_xm, stride_we,
                                        stride_wn, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, FUSED, W_TMA, NATIVE)
            tile_c += tl.num_programs(0)
            pid_m, pid_n = _tile(tile_c, used, num_n, GROUP_M)
            _gate_up_store(out_ptr, acc_g, acc_u, pid_m, pid_n, I, stride_om, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n = _tile(tl.program_id(0), num_blocks, num_n, GROUP_M)
        e = tl.load(block_expert_ptr + pid_m)
        if (e < 0) | (e >= num_experts):
            return
        acc_g, acc_u = _gate_up_acc(x_ptr, w, sorted_ids_ptr, e, pid_m, pid_n, n, H, I, stride_xm, stride_we,
                                    stride_wn, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, FUSED, W_TMA, NATIVE)
        _gate_up_store(out_ptr, acc_g, acc_u, pid_m, pid_n, I, stride_om, BLOCK_M, BLOCK_N)


@triton.jit
def _gate_up_acc(x_ptr, w, sorted_ids_ptr, e, pid_m, pid_n, n, H, I, stride_xm, stride_we, stride_wn,
                 TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FUSED: tl.constexpr, W_TMA: tl.constexpr, NATIVE: tl.constexpr):
    """One tile's gate and up accumulators [BLOCK_M, BLOCK_N] (float32)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    valid = (ids >= 0) & (ids < n)
    tok = (ids // TOP_K).to(tl.int64)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xm + ks[None, :]
    if FUSED:
        if not W_TMA:
            # column 2j of the tile is gate column n0 + j, column 2j + 1 its up column
            c = tl.arange(0, 2 * BLOCK_N)
            pair_ok = n0 + c // 2 < I
            w_ptrs = (w + e.to(tl.int64) * stride_we + (n0 + c // 2 + (c % 2) * I)[None, :].to(tl.int64) * stride_wn
                      + ks[:, None])
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = ks < H - k0
            a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            if W_TMA:  # [gate rows; up rows] -> columns [gate | up]
                b = tl.reshape(w.load([2 * e, n0, k0]), (2 * BLOCK_N, BLOCK_K)).T
            else:
                b = tl.load(w_ptrs, mask=k_ok[:, None] & pair_ok[None, :], other=0.0)
                w_ptrs += BLOCK_K
            acc += mma(a, b, NATIVE)
            x_ptrs += BLOCK_K
        if W_TMA:
            acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1))
        else:
            acc = tl.reshape(acc, (BLOCK_M, BLOCK_N, 2))
        acc_g, acc_u = tl.split(acc)
    else:
        if not W_TMA:
            g_ptrs = w + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
            u_ptrs = g_ptrs + I * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = ks < H - k0
            a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            if W_TMA:  # the descriptor zero-fills past H; a gate tile past I reads up rows, masked below
                g = w.load([e * (2 * I) + n0, k0]).T
                u = w.load([e * (2 * I) + I + n0, k0]).T
            else:
                g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
            acc_g += mma(a, g, NATIVE)
            acc_u += mma(a, u, NATIVE)
            x_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _gate_up_store(out_ptr, acc_g, acc_u, pid_m, pid_n, I, stride_om, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dt = out_ptr.dtype.element_ty
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], (act * up).to(dt),
             mask=(cols < I)[None, :])


@triton.jit(do_not_specialize=["n", "num_blocks"])
def _moe_down_kernel(a, w, out_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr, n, num_blocks,
                     num_experts, H, I,
                     stride_am, stride_we, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     TMA: tl.constexpr, PERSISTENT: tl.constexpr, NATIVE: tl.constexpr):
    # a, w: act's and w2's pointers, or with TMA their descriptors ([rows, I] and [E * H, I])
    num_n = tl.cdiv(H, BLOCK_N)
    if PERSISTENT:
        used = _used_blocks(block_expert_ptr, num_blocks)
        tile_c = tl.program_id(0) - tl.num_programs(0)
        for tile in tl.range(tl.program_id(0), used * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _tile(tile, used, num_n, GROUP_M)
            e = _block_expert(block_expert_ptr, pid_m, num_experts)
            acc = _down_acc(a, w, e, pid_m, pid_n, H, I, stride_am, stride_we, stride_wn, BLOCK_M, BLOCK_N,
                            BLOCK_K, TMA, NATIVE)
            tile_c += tl.num_programs(0)
            pid_m, pid_n = _tile(tile_c, used, num_n, GROUP_M)
            _down_store(out_ptr, acc, sorted_ids_ptr, weights_ptr, pid_m, pid_n, n, H, stride_om, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n = _tile(tl.program_id(0), num_blocks, num_n, GROUP_M)
        e = tl.load(block_expert_ptr + pid_m)
        if (e < 0) | (e >= num_experts):
            return
        acc = _down_acc(a, w, e, pid_m, pid_n, H, I, stride_am, stride_we, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                        TMA, NATIVE)
        _down_store(out_ptr, acc, sorted_ids_ptr, weights_ptr, pid_m, pid_n, n, H, stride_om, BLOCK_M, BLOCK_N)


@triton.jit
def _down_acc(a, w, e, pid_m, pid_n, H, I, stride_am, stride_we, stride_wn, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, NATIVE: tl.constexpr):
    """One tile of act @ w2[e].T [BLOCK_M, BLOCK_N] (float32)."""
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:  # zero fill past I; a tile past H reads the next expert's rows, which the store masks
        for k0 in range(0, I, BLOCK_K):
            acc += mma(a.load([pid_m * BLOCK_M, k0]), w.load([e * H + n0, k0]).T, NATIVE)
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        w_ptrs = w + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
        for k0 in range(0, I, BLOCK_K):
            k_ok = ks < I - k0
            x = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            y = tl.load(w_ptrs, mask=k_ok[:, None] & (cols < H)[None, :], other=0.0)
            acc += mma(x, y, NATIVE)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _down_store(out_ptr, acc, sorted_ids_ptr, weights_ptr, pid_m, pid_n, n, H, stride_om, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A tile's rows times their routing weights, each in the row of its assignment."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    valid = (ids >= 0) & (ids < n)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dt = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + ids, mask=valid, other=0.0)
    y = acc.to(dt).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + ids[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(dt),
             mask=valid[:, None] & (cols < H)[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0, num_global_experts: int | None = None,
              p: Plan | None = None) -> torch.Tensor:
    """kernels/moe_reference.py's fused_moe on the Triton kernels: x [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] -> [T, H]. num_global_experts: the
    model's experts, where this rank holds only E of them (expert parallel)."""
    t = x.shape[0]
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    assert topk_ids.shape == topk_weights.shape == (t, top_k), "topk_ids and topk_weights must be [T, k]"
    if t == 0:
        return torch.zeros_like(x)
    p = p or plan(t, top_k, num_experts, itemsize=x.element_size())
    sorted_ids, block_expert = align(topk_ids, num_experts, expert_start, p.block_m)
    # a token's pick of another rank's expert leaves its row unwritten: it must read zero
    rows = experts(x, w13, w2, topk_weights, sorted_ids, block_expert, p,
                   zero_fill=num_global_experts not in (None, num_experts))
    return sum_rows(rows, top_k)


def sum_rows(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """rows [T*k, H] (a token's k rows one after another) -> [T, H], summed in float32."""
    n, h = rows.shape
    assert n % top_k == 0 and rows.stride(1) == 1, "rows must be [T*k, H] with contiguous rows"
    out = torch.empty((n // top_k, h), dtype=rows.dtype, device=rows.device)
    launch(_moe_sum_kernel, (n // top_k, cdiv(h, 1024)), rows, out, h, rows.stride(0), out.stride(0), TOP_K=top_k,
           BLOCK_H=1024, num_warps=4)
    return out


@triton.jit
def _moe_sum_kernel(rows_ptr, out_ptr, H, stride_r, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # a token's k rows (in its assignments' order) summed in float32: [T*k, H] -> [T, H]
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            sorted_ids: torch.Tensor, block_expert: torch.Tensor, p: Plan, zero_fill: bool = False) -> torch.Tensor:
    """The two grouped matmuls over align()'s rows -> [T*k, H]: each assignment's weighted expert
    output (rows of assignments no local expert took: zeros with zero_fill, else undefined)."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    assert w13.shape[2] == h and w2.shape == (num_experts, h, two_i // 2), "w13 [E, 2I, H] and w2 [E, H, I] must match x [T, H]"
    assert x.dtype == w13.dtype == w2.dtype and topk_weights.dtype == torch.float32, "x, w13, w2 of one dtype; float32 weights"
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1 and topk_weights.is_contiguous(), \
        "rows must be contiguous"
    act = gate_up(x, w13, sorted_ids, block_expert, topk_weights.shape[1], p)
    return down(act, w2, sorted_ids, block_expert, topk_weights, p, zero_fill)


def gate_up(x: torch.Tensor, w13: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, top_k: int,
            p: Plan, compile_only: bool = False) -> torch.Tensor:
    """The first grouped matmul: act [blocks * BLOCK_M, I] in align()'s row order, silu(gate) * up
    (padding rows: zeros; the rows of blocks without an expert: undefined). compile_only: Triton's
    compile of this launch and nothing run (a sweep compiles its variants on threads)."""
    num_experts, two_i, h = w13.shape
    inter = two_i // 2
    blocks = block_expert.shape[0]
    act = torch.empty((blocks * p.block_m, inter), dtype=x.dtype, device=x.device)
    tma = p.tma and _stacked_tma(w13)
    w: object = w13
    if tma and p.fuse_gate_up:  # [E * 2, I, H]: an expert's gate rows, then its up rows
        w = TensorDescriptor(w13, [num_experts * 2, inter, h], [inter * w13.stride(1), w13.stride(1), 1],
                             [2, p.block_n, p.block_k])
    elif tma:
        w = TensorDescriptor(w13, [num_experts * two_i, h], [w13.stride(1), 1], [p.block_n, p.block_k])
    _start(_moe_gate_up_kernel, _grid(blocks * cdiv(inter, p.block_n), p.persistent, x.device), compile_only,
           x, w, act, sorted_ids, block_expert, x.shape[0] * top_k, blocks, num_experts, h, inter,
           x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
           TOP_K=top_k, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
           FUSED=p.fuse_gate_up, W_TMA=tma, PERSISTENT=p.persistent, NATIVE=_native(x), num_warps=p.num_warps,
           num_stages=p.num_stages)
    return act


def down(act: torch.Tensor, w2: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
         topk_weights: torch.Tensor, p: Plan, zero_fill: bool = False, compile_only: bool = False) -> torch.Tensor:
    """The second grouped matmul: act @ w2[e].T times each row's routing weight, in the row of its
    assignment -> [T*k, H] (see experts()); compile_only as gate_up's."""
    num_experts, h, inter = w2.shape
    n = topk_weights.numel()
    blocks = block_expert.shape[0]
    d = p.down_tiles()
    rows = (torch.zeros if zero_fill else torch.empty)((n, h), dtype=act.dtype, device=act.device)
    tma = d.tma and _stacked_tma(w2) and _stacked_tma(act.unsqueeze(0))
    a: object = act
    w: object = w2
    if tma:
        a = TensorDescriptor(act, list(act.shape), [act.stride(0), 1], [p.block_m, d.block_k])
        w = TensorDescriptor(w2, [num_experts * h, inter], [w2.stride(1), 1], [d.block_n, d.block_k])
    _start(_moe_down_kernel, _grid(blocks * cdiv(h, d.block_n), d.persistent, act.device), compile_only,
           a, w, rows, sorted_ids, block_expert, topk_weights, n, blocks, num_experts, h, inter,
           act.stride(0), w2.stride(0), w2.stride(1), rows.stride(0),
           BLOCK_M=p.block_m, BLOCK_N=d.block_n, BLOCK_K=d.block_k, GROUP_M=d.group_m, TMA=tma,
           PERSISTENT=d.persistent, NATIVE=_native(act), num_warps=d.num_warps, num_stages=d.num_stages)
    return rows


def _grid(tiles: int, persistent: bool, device: torch.device) -> tuple[int]:
    """One program a tile, or a persistent launch's one an SM (4 on the CPU: the interpreter walks
    several tiles a program too)."""
    if not persistent:
        return (tiles,)
    return (max(1, min(tiles, sm_count(device) if device.type == "cuda" else 4)),)


def _native(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _stacked_tma(t: torch.Tensor) -> bool:
    """t [E, R, C] can be one TMA descriptor over its E * R rows: rows contiguous, the experts one
    after another, rows and base 16-byte aligned."""
    return (TensorDescriptor is not None and t.stride(2) == 1 and t.stride(0) == t.shape[1] * t.stride(1)
            and (t.stride(1) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


def _start(fn, grid: tuple[int, ...], compile_only: bool, *args, **kwargs) -> None:
    if not compile_only:
        launch(fn, grid, *args, **kwargs)
    elif os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter compiles nothing
        fn.warmup(*args, grid=grid, **kwargs)
