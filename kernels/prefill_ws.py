"""Hopper prefill attention in Gluon: warp-specialized, asynchronous wgmma, TMA.

The same varlen causal attention as prefill_attention.py (each chunk's new tokens over its
sequence's cached prefix in the pages, then over themselves) for 16-bit pages with this step's
contiguous k, v, written the way FlashAttention-3 is, which Triton's `tl` cannot express: a
1-warp producer streams K and V tiles by TMA into a ring of STAGES buffers (prefix tiles a page
of one head per TMA box, through the block table; new-key tiles from k, v), and two 4-warp
consumers (one warpgroup each, 64 query rows each) run the softmax of key tile t while their
tensor cores still multiply tile t-1's probabilities by V. mbarriers hand the buffers over:
`ready` when the TMA landed, `empty` when both consumers' wgmmas that read it have completed.

Persistent: one program an SM takes work items (query tile of BLOCK_M = 128 rows, head) in turn,
the last tiles first as prefill_attention.py's plain grid orders them, or the items of its work
lists for every head; neighbouring items are neighbouring heads, which share their KV head's
tiles in L2. paged_prefill_attention launches it where prefill_plan() says so (an sm_90
GPU, chunks longer than 64 tokens). The CPU interpreter cannot run Gluon: the CPU suite compiles
it for sm_90 (tests/kernels/test_prefill_ws.py), the GPU tests run it.
"""
from __future__ import annotations

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                    warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    # Triton 3.6 (the GPU's) names the TMA load async_copy_global_to_shared; 3.9 (CI's) async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon: prefill_attention.py serves every case
    gluon = None

from kernels.attn_common import LOG2E
from kernels.launch import sm_count

BLOCK_M, BLOCK_N, STAGES = 128, 128, 2


if gluon is not None:

    @gluon.jit
    def _load_pages(desc, bt_row, first_page, last_page, kvh, bar, buf, NUM_KV_HEADS: gl.constexpr):
        """One tile of a KV head's cached keys (or values) by TMA, a page (block_size rows) at a time;
        pages past the prefix's last repeat it (finite values; the consumers mask those keys)."""
        BLOCK_N: gl.constexpr = buf.type.shape[0]
        BLOCK_SIZE: gl.constexpr = desc.block_type.shape[0]
        mbarrier.expect(bar, BLOCK_N * desc.block_type.nbytes // BLOCK_SIZE)
        for i in gl.static_range(BLOCK_N // BLOCK_SIZE):
            blk = gl.load(bt_row + gl.minimum(first_page + i, last_page))
            _tma_load(desc, [(blk * NUM_KV_HEADS + kvh) * BLOCK_SIZE, 0], bar, buf.slice(i * BLOCK_SIZE, BLOCK_SIZE))

    @gluon.jit
    def _zero_rows_from(buf, first_zero):
        """Rows >= first_zero of a [BLOCK_N, D] tile in shared memory set to 0 (one warp)."""
        BLOCK_N: gl.constexpr = buf.type.shape[0]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        for i in gl.static_range(BLOCK_N // 16):
            if (i + 1) * 16 > first_zero:
                part = buf.slice(i * 16, 16)
                row = i * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
                x = part.load(layout)
                part.store(gl.where((row < first_zero)[:, None], x, gl.zeros_like(x)))

    @gluon.jit
    def _load_v(v_desc, vc_desc, bt_row, kv_row, kvh, t, n_pre, last_page, bar, buf, NUM_KV_HEADS: gl.constexpr):
        """An item's key tile t of V: from the pages (t < n_pre) or this step's v (row kv_row on)."""
        HEAD_DIM: gl.constexpr = v_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = v_desc.block_type.shape[0]
        BLOCK_SIZE: gl.constexpr = vc_desc.block_type.shape[0]
        if t < n_pre:
            _load_pages(vc_desc, bt_row, t * (BLOCK_N // BLOCK_SIZE), last_page, kvh, bar, buf, NUM_KV_HEADS)
        else:
            mbarrier.expect(bar, v_desc.block_type.nbytes)
            _tma_load(v_desc, [kv_row + (t - n_pre) * BLOCK_N, kvh * HEAD_DIM], bar, buf)

    @gluon.jit
    def _softmax(s, qpos, key0, limit, qk_scale, m_i, MASK: gl.constexpr, s_layout: gl.constexpr):
        """A tile's raw scores -> (p, the new running max, alpha = the old max's correction).
        MASK: keys at sequence positions key0 + n are kept where < limit and <= the query's."""
        BLOCK_N: gl.constexpr = s.type.shape[1]
        if MASK:
            key = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = (key[None, :] <= qpos[:, None]) & (key[None, :] < limit)
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # qk_scale > 0
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, alpha

    @gluon.jit
    def _step(q, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc, l_i, m_i, p_op, zero_s, qpos, r, key0,
              limit, qk_scale, MASK: gl.constexpr, STAGES: gl.constexpr):
        """Ring tile r (not an item's first): S_r = Q K_r^T and O += P_{r-1} V_{r-1} both in flight
        while S_r's softmax runs; then O is rescaled and P_r becomes the next step's A operand."""
        s_layout: gl.constexpr = zero_s.type.layout
        o_layout: gl.constexpr = acc.type.layout
        idx = r % STAGES
        prev = (r - 1) % STAGES
        mbarrier.wait(k_ready.index(idx), (r // STAGES) & 1)
        s = warpgroup_mma(q, k_bufs.index(idx).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((r - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))  # groups complete in order: S_r is done
        mbarrier.arrive(k_empty.index(idx), count=1)
        p, m_i, alpha = _softmax(s, qpos, key0, limit, qk_scale, m_i, MASK, s_layout)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(p_op.dtype), p_op.type.layout)
        return acc, l_i, m_i, p_op

    @gluon.jit
    def _item(i, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_heads,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WORK: gl.constexpr):
        """Work item i -> (head, q_start, q_len, prefix, kv_new, row0, n_pre, n_tiles, block table row).
        Items run the last query tiles (the longest rows) first, heads fastest."""
        if WORK:  # item (b << 16) | query tile, for every head; WORK_PAD's tile starts past any chunk
            item = gl.load(work_ptr + i // n_heads)
            b = item >> 16
            m_tile = item & 0xFFFF
            head = i % n_heads
        else:
            bh = i % num_bh
            b = bh // n_heads
            head = bh % n_heads
            m_tile = num_m_tiles - 1 - i // num_bh
        q_start = gl.load(qsl_ptr + b)
        q_len = gl.load(qsl_ptr + b + 1) - q_start
        seq_len = gl.load(sl_ptr + b)
        # q_len > seq_len (no valid chunk: the runner's profiling pass) reads no key outside
        # [0, seq_len) and nothing of k/v beyond the chunk
        prefix = gl.maximum(seq_len - q_len, 0)
        kv_new = seq_len - prefix
        row0 = m_tile * BLOCK_M
        n_pre = gl.cdiv(prefix, BLOCK_N)
        # key tiles: the prefix's, then the new keys' up to the tile's last row (none when the
        # tile starts past the chunk)
        n_tiles = (n_pre + gl.cdiv(gl.minimum(row0 + BLOCK_M, kv_new), BLOCK_N)) * (row0 < q_len).to(gl.int32)
        return head, q_start, q_len, prefix, kv_new, row0, n_pre, n_tiles, bt_ptr + b.to(gl.int64) * stride_btb

    @gluon.jit
    def _produce(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty,
                 v_ready, v_empty, v_tma, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_items,
                 NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, STAGES: gl.constexpr, WORK: gl.constexpr):
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        BLOCK_SIZE: gl.constexpr = kc_desc.block_type.shape[0]
        tc = 0  # ring tiles so far
        qc = 0  # items so far (Q buffers alternate)
        vz = 0  # V tiles zeroed so far (v_tma's phase)
        for i in range(gl.program_id(0), n_items, gl.num_programs(0)):
            head, q_start, q_len, prefix, kv_new, row0, n_pre, n_tiles, bt_row = _item(
                i, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, NUM_HEADS, BLOCK_M, BLOCK_N,
                WORK)
            if n_tiles > 0:
                kvh = head // (NUM_HEADS // NUM_KV_HEADS)
                qi = qc % 2
                # a fresh mbarrier counts as having completed the phase before phase 0
                mbarrier.wait(q_empty.index(qi), ((qc // 2) & 1) ^ 1)
                mbarrier.expect(q_ready.index(qi), q_desc.block_type.nbytes)
                _tma_load(q_desc, [q_start + row0, head * HEAD_DIM], q_ready.index(qi), q_bufs.index(qi))
                last_page = (prefix - 1) // BLOCK_SIZE
                for t in range(n_tiles):
                    r = tc + t
                    idx = r % STAGES
                    phase = (r // STAGES) & 1
                    mbarrier.wait(k_empty.index(idx), phase ^ 1)
                    if t < n_pre:  # the cached prefix, from the pages
                        _load_pages(kc_desc, bt_row, t * (BLOCK_N // BLOCK_SIZE), last_page, kvh, k_ready.index(idx),
                                    k_bufs.index(idx), NUM_KV_HEADS)
                    else:  # the chunk's own keys, from this step's k
                        mbarrier.expect(k_ready.index(idx), k_desc.block_type.nbytes)
                        _tma_load(k_desc, [q_start + (t - n_pre) * BLOCK_N, kvh * HEAD_DIM], k_ready.index(idx),
                                  k_bufs.index(idx))
                    mbarrier.wait(v_empty.index(idx), phase ^ 1)
                    # a V tile that runs past the prefix or the chunk holds other tokens' values there
                    # (stale slots of the last page, the next sequence's rows): their probabilities are
                    # 0, but 0 * inf or NaN is not, so those rows are zeroed before the consumers see it
                    valid = gl.where(t < n_pre, prefix - t * BLOCK_N, kv_new - (t - n_pre) * BLOCK_N)
                    if valid < BLOCK_N:
                        _load_v(v_desc, vc_desc, bt_row, q_start, kvh, t, n_pre, last_page, v_tma, v_bufs.index(idx),
                                NUM_KV_HEADS)
                        mbarrier.wait(v_tma, vz & 1)
                        _zero_rows_from(v_bufs.index(idx), valid)
                        fence_async_shared()  # the zeros before the consumers' wgmma reads (async proxy)
                        mbarrier.arrive(v_ready.index(idx), count=1)
                        vz += 1
                    else:
                        _load_v(v_desc, vc_desc, bt_row, q_start, kvh, t, n_pre, last_page, v_ready.index(idx),
                                v_bufs.index(idx), NUM_KV_HEADS)
                tc += n_tiles
                qc += 1

    @gluon.jit
    def _consume_item(q, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, out_ptr, stride_ot, stride_oh, q_start,
                      q_len, first, head, prefix, kv_new, n_pre, n_tiles, tc, qk_scale, STAGES: gl.constexpr):
        """One work item's 64 query rows from token `first` of the chunk: ring tiles tc .. tc+n_tiles-1."""
        HALF_M: gl.constexpr = q.type.shape[0]
        HEAD_DIM: gl.constexpr = q.type.shape[1]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        dtype: gl.constexpr = q.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        qpos = prefix + first + gl.arange(0, HALF_M, layout=row_s)  # the queries' sequence positions
        seq_len = prefix + kv_new
        # tiles 0 .. n_pre-1: the prefix (the last one partial unless prefix % BLOCK_N == 0); then
        # the new keys, unmasked below this warpgroup's first token, masked from there
        pre_full = prefix // BLOCK_N
        new_full = n_pre + gl.minimum(first, kv_new) // BLOCK_N
        zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_s)

        idx = tc % STAGES
        mbarrier.wait(k_ready.index(idx), (tc // STAGES) & 1)
        s = warpgroup_mma(q, k_bufs.index(idx).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(idx), count=1)
        if n_pre > 0:
            p, m_i, alpha = _softmax(s, qpos, 0, prefix, qk_scale, m_i, True, s_layout)
        else:
            p, m_i, alpha = _softmax(s, qpos, prefix, seq_len, qk_scale, m_i, True, s_layout)
        l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for t in range(1, pre_full):
            acc, l_i, m_i, p_op = _step(q, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc, l_i, m_i, p_op,
                                        zero_s, qpos, tc + t, 0, 0, qk_scale, False, STAGES)
        for t in range(gl.maximum(pre_full, 1), n_pre):
            acc, l_i, m_i, p_op = _step(q, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc, l_i, m_i, p_op,
                                        zero_s, qpos, tc + t, t * BLOCK_N, prefix, qk_scale, True, STAGES)
        for t in range(gl.maximum(n_pre, 1), new_full):
            acc, l_i, m_i, p_op = _step(q, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc, l_i, m_i, p_op,
                                        zero_s, qpos, tc + t, 0, 0, qk_scale, False, STAGES)
        for t in range(gl.maximum(new_full, 1), n_tiles):
            acc, l_i, m_i, p_op = _step(q, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc, l_i, m_i, p_op,
                                        zero_s, qpos, tc + t, prefix + (t - n_pre) * BLOCK_N, seq_len, qk_scale,
                                        True, STAGES)
        last = tc + n_tiles - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_bufs.index(last % STAGES), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        l_o = gl.convert_layout(l_i, row_o)
        out = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
        rows = first + gl.arange(0, HALF_M, layout=row_o)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        offs = (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
        gl.store(out_ptr + offs, out.to(dtype), mask=(rows < q_len)[:, None])

    @gluon.jit
    def _consume(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, out_ptr, stride_ot,
                 stride_oh, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_items, qk_scale,
                 NUM_HEADS: gl.constexpr, STAGES: gl.constexpr, WORK: gl.constexpr, HALF: gl.constexpr):
        BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HALF_M: gl.constexpr = BLOCK_M // 2
        tc = 0
        qc = 0
        for i in range(gl.program_id(0), n_items, gl.num_programs(0)):
            head, q_start, q_len, prefix, kv_new, row0, n_pre, n_tiles, bt_row = _item(
                i, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, NUM_HEADS, BLOCK_M, BLOCK_N,
                WORK)
            if n_tiles > 0:
                qi = qc % 2
                mbarrier.wait(q_ready.index(qi), (qc // 2) & 1)
                _consume_item(q_bufs.index(qi).slice(HALF * HALF_M, HALF_M, dim=0), k_bufs, v_bufs, k_ready, k_empty,
                              v_ready, v_empty, out_ptr, stride_ot, stride_oh, q_start, q_len, row0 + HALF * HALF_M,
                              head, prefix, kv_new, n_pre, n_tiles, tc, qk_scale, STAGES)
                mbarrier.arrive(q_empty.index(qi), count=1)  # its last wgmma has completed
                tc += n_tiles
                qc += 1

    # warp_specialize takes a function per partition: HALF is fixed by one of these two each (a
    # constant in a partition's argument tuple does not reach the callee as a constexpr)
    @gluon.jit
    def _consume0(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, out_ptr, stride_ot,
                  stride_oh, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_items, qk_scale,
                  NUM_HEADS: gl.constexpr, STAGES: gl.constexpr, WORK: gl.constexpr):
        _consume(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, out_ptr, stride_ot,
                 stride_oh, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_items, qk_scale, NUM_HEADS,
                 STAGES, WORK, 0)

    @gluon.jit
    def _consume1(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, out_ptr, stride_ot,
                  stride_oh, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_items, qk_scale,
                  NUM_HEADS: gl.constexpr, STAGES: gl.constexpr, WORK: gl.constexpr):
        _consume(q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, out_ptr, stride_ot,
                 stride_oh, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_items, qk_scale, NUM_HEADS,
                 STAGES, WORK, 1)

    # per-step values are not specialized (see prefill_attention.py's kernel)
    @gluon.jit(do_not_specialize=["num_m_tiles", "n_items", "num_bh"],
               do_not_specialize_on_alignment=["bt_ptr", "sl_ptr", "qsl_ptr", "work_ptr"])
    def _prefill_ws_kernel(q_desc, k_desc, v_desc, kc_desc, vc_desc, out_ptr, bt_ptr, sl_ptr, qsl_ptr, work_ptr,
                           qk_scale, num_m_tiles, n_items, num_bh, stride_ot, stride_oh, stride_btb,
                           NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, STAGES: gl.constexpr,
                           WORK: gl.constexpr):
        """Persistent: program p takes work items p, p + grid, ... (_item), so the producer loads
        the next item's Q and first tiles while the consumers finish the last one's."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_tma = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(v_tma, count=1)
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        consumer_args = (q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, out_ptr,
                         stride_ot, stride_oh, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb, num_bh, n_items,
                         qk_scale, NUM_HEADS, STAGES, WORK)
        producer_args = (q_desc, k_desc, v_desc, kc_desc, vc_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                         k_empty, v_ready, v_empty, v_tma, work_ptr, num_m_tiles, qsl_ptr, sl_ptr, bt_ptr, stride_btb,
                         num_bh, n_items, NUM_HEADS, NUM_KV_HEADS, STAGES, WORK)
        gl.warp_specialize([(_consume0, consumer_args), (_consume1, consumer_args), (_produce, producer_args)],
                           [4, 1], [232, 40])


_HOPPER: dict[int, bool] = {}


def ws_available(q: torch.Tensor) -> bool:
    """Whether this kernel can run on q's device: Gluon present, a Hopper (sm_90) GPU (asked once
    per device: prefill_plan() calls this for every step)."""
    if gluon is None or not q.is_cuda:
        return False
    i = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if i not in _HOPPER:
        _HOPPER[i] = torch.cuda.get_device_capability(q.device) == (9, 0)
    return _HOPPER[i]


def tma_2d(t: torch.Tensor) -> bool:
    """[rows, heads, head_dim] viewable as a 2-D [rows, heads * head_dim] TMA tensor: heads
    contiguous, 16-byte aligned base and rows."""
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def ws_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> bool:
    """Inputs the kernel takes: 16-bit q, k, v and pages all of one dtype, head_dim 64 or 128, pages
    of at most BLOCK_N tokens, every tensor TMA-addressable (heads contiguous, 16-byte aligned rows)."""
    bs = k_cache.shape[2]
    return (q.dtype in (torch.bfloat16, torch.float16) and all(t.dtype == q.dtype for t in (k, v, k_cache, v_cache))
            and q.shape[2] in (64, 128) and q.shape[1] % k.shape[1] == 0 and bs <= BLOCK_N and BLOCK_N % bs == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous() and all(map(tma_2d, (q, k, v))))


def _layout(dtype: torch.dtype, rows: int, head_dim: int):
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.float16 if dtype == torch.float16 else gl.bfloat16)


def _descriptor(t: torch.Tensor, rows: int, layout=None):
    """t [R, H, D] as a 2-D [R * H, D]-wide TMA tensor [R, H * D] with boxes of `rows` x D."""
    R, H, D = t.shape
    return GluonDescriptor(t, [R, H * D], [t.stride(0), 1], [rows, D], layout or _layout(t.dtype, rows, D))


def _page_descriptor(cache: torch.Tensor, layout):
    """Pages [num_blocks, kv_heads, block_size, D] as rows [num_blocks * kv_heads * block_size, D],
    one page of one head per box; the tiles' own shared layout (a page lands in a slice of a tile)."""
    nb, H, bs, D = cache.shape
    return GluonDescriptor(cache, [nb * H * bs, D], [D, 1], [bs, D], layout)


def _num_sms(device: torch.device) -> int:
    """Persistent programs: one per SM (132 on an H100 SXM); 132 off a GPU (the CPU compile test)."""
    return sm_count(device) if device.type == "cuda" else 132


def ws_launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   out: torch.Tensor, softmax_scale: float, max_query_len: int,
                   work: torch.Tensor | None = None) -> tuple:
    """(grid, args, kwargs) of the kernel's launch (the CPU compile test builds them too)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    B = seq_lens.shape[0]
    num_m_tiles = triton.cdiv(max_query_len, BLOCK_M)
    n_items = B * Hq * num_m_tiles if work is None else Hq * work.shape[0]
    tile = _layout(q.dtype, BLOCK_N, D)
    args = (_descriptor(q, BLOCK_M), _descriptor(k, BLOCK_N, tile), _descriptor(v, BLOCK_N, tile),
            _page_descriptor(k_cache, tile), _page_descriptor(v_cache, tile), out, block_tables, seq_lens,
            query_start_loc, query_start_loc if work is None else work,
            softmax_scale * LOG2E, num_m_tiles, n_items, B * Hq, out.stride(0), out.stride(1), block_tables.stride(0))
    # 12 warps (three warpgroups, the producer's padded): 168 registers a thread fit 65,536; the
    # producer gives most of its share to the consumers (setmaxnreg), which get 232 each
    kwargs = dict(NUM_HEADS=Hq, NUM_KV_HEADS=Hkv, STAGES=STAGES, WORK=work is not None, num_warps=4, maxnreg=168)
    grid = (max(1, min(n_items, _num_sms(q.device))),)
    return grid, args, kwargs


def relaunch_changes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, out: torch.Tensor, softmax_scale: float, args: list) -> tuple:
    """The argument changes (position, value) that turn a bound launch of ws_launch_args()'s args
    into the same attention over other tensors of the same shapes (another layer of the step)."""
    changes = [(5, out), (10, softmax_scale * LOG2E)]
    tile = args[1].layout
    for i, t, rows in ((0, q, BLOCK_M), (1, k, BLOCK_N), (2, v, BLOCK_N)):
        if args[i].base is not t:
            changes.append((i, _descriptor(t, rows, args[i].layout)))
    for i, cache in ((3, k_cache), (4, v_cache)):
        if args[i].base is not cache:
            changes.append((i, _page_descriptor(cache, tile)))
    return tuple(changes)
