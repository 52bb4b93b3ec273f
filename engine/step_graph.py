"""Whole-step CUDA graphs for steps with prefill tokens: attention inside the graph too.

The piecewise graphs (engine/piecewise.py) leave attention out, so a mixed step of Qwen2.5-0.5B
still costs 25 graph launches, 48 attention launches and ~8 input copies: ~3 ms of host time on
the H100 machine, as long as the step's device time when it carries one prompt. Here attention
runs on fixed grids, so a step of n <= max_tokens tokens is one graph launch after one upload
(~1.2 ms of host time for that step; its device time fell by ~0.2 ms and serving throughput moved
within the noise, bench/NOTES.md, 2026-11-24):

- decode attention over the first R rows, R = the decode count rounded up to a power of two (the
  rounding the eager path's split plan makes, kernels/paged_attention.py decode_config, so both
  compute the same): rows past the decodes are padding of one token, or prefill rows whose output
  prefill attention then overwrites;
- prefill attention over a work list (kernels/prefill_attention.py work_list): item (b, query
  tile) for each tile of each chunk, padding items do nothing; chunk j's sequence is entry R + j
  of the graph's seq_lens, block tables and query starts (rows of q).

One graph per (R, token bucket T >= R), captured after the piecewise graphs into their memory
pool. Their token buckets are finer than the piecewise graphs' above 512 tokens (step_buckets):
a step's matmuls compute all T rows, and a batch of decodes plus one prompt (e.g. 63 + 512
tokens) would otherwise compute 768. Every input lives in one device buffer that a single copy
fills (layout in StepGraphs.run), except the block tables, which one more copy spreads to their
full width (the decode plan depends on it).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from engine.attention import Ops, attend_fixed, rotate_and_store
from engine.cost_model import StepCostModel
from engine.cuda_graph import capture_graph, smallest_bucket
from engine.models.llama import LlamaForCausalLM
from engine.piecewise import PiecewiseGraphs, piecewise_buckets
from engine.upload import HostInputs, UploadRing, take_pending
from kvcache.pool import LayerCache

log = logging.getLogger("pagedserve")

MAX_PREFILLS = 16  # chunks in one step graph; a step with more runs piecewise


def step_buckets(max_tokens: int, skip: frozenset[int] = frozenset()) -> list[int]:
    """Token counts to capture: the piecewise graphs', plus every 64 from 512 to 1024 and every 128
    above (padding < 1/8 of a step from 512 tokens up), less those in skip."""
    return piecewise_buckets(max_tokens, skip, fine_above=0)


def graph_token_limits(costs: StepCostModel | None, budgeted: bool, max_num_batched_tokens: int,
                       step_graph_max_tokens: int, max_num_seqs: int, tp: int, whole_steps: bool) -> tuple[int, int]:
    """(the largest step the piecewise graphs capture, the largest the whole-step graphs capture, 0:
    none): the engine's rule, which `serve kv-calc` runs on a roofline cost model. With a prompt budget
    (budgeted) both stop at the largest mixed step it allows (bigger steps are compute bound and
    launched eagerly: nothing is lost, and start-up captures far fewer graphs). Under TP each
    whole-step graph holds NCCL's memory for its ~2 all-reduces a layer (engine/parallel/graph_memory.py:
    19 MB a graph on the 70B), so they stop at the steps the host paces (on two H100s a 70B step of 16
    tokens takes ~25 ms: none is). whole_steps False (a pipeline stage, ops without work lists): none."""
    piecewise, step = max_num_batched_tokens, min(step_graph_max_tokens, max_num_batched_tokens)
    if budgeted and costs is not None:
        piecewise = min(piecewise, costs.largest_mixed_step(max_num_seqs))
        step = min(step, piecewise)
    if tp > 1 and costs is not None:
        step = min(step, costs.host_bound_rows())
    return piecewise, step if whole_steps else 0


def step_rows(max_num_seqs: int) -> list[int]:
    """Decode-row counts R of the graphs: 1, 2, 4, .. the power of two at or above max_num_seqs."""
    top = 1 << (max_num_seqs - 1).bit_length()
    return [1 << i for i in range(top.bit_length())]


def step_shapes(max_num_seqs: int, token_buckets: list[int]) -> list[tuple[int, int]]:
    """Every (R, T) pair captured: each row count with each token bucket that holds it."""
    return [(rows, t) for t in token_buckets for rows in step_rows(max_num_seqs) if rows <= t]


def graphed_token_counts(max_num_seqs: int, piecewise_tokens: int, step_tokens: int,
                         skip: frozenset[int] = frozenset()) -> list[int]:
    """The token count of every graphed forward with prompt tokens: each piecewise bucket up to
    piecewise_tokens, then each whole-step (R, T) pair up to step_tokens (0: none), less the skipped
    buckets (what NCCL's share of graph memory counts: engine/parallel/graph_memory.py)."""
    counts = piecewise_buckets(piecewise_tokens, skip, fine_above=step_tokens)
    if step_tokens > 0:
        buckets = step_buckets(min(step_tokens, piecewise_tokens), skip)
        counts += [t for _, t in step_shapes(max_num_seqs, buckets)]
    return counts


class StepGraphs:
    def __init__(self, model: LlamaForCausalLM, ops: Ops, caches: list[LayerCache], piecewise: PiecewiseGraphs,
                 max_num_seqs: int, max_blocks_per_seq: int, max_tokens: int, device: torch.device,
                 skip: frozenset[int] = frozenset()) -> None:
        self.model, self.ops, self.caches, self.pw = model, ops, caches, piecewise
        # Triton: only where graphs are captured
        from kernels.prefill_attention import prefill_plan, work_list

        self.token_buckets = step_buckets(min(max_tokens, piecewise.max_tokens), skip)
        self.max_tokens = self.token_buckets[-1]
        self.decode_rows = step_rows(max_num_seqs)  # R: 1, 2, 4, .. top
        self.num_seqs = self.decode_rows[-1] + MAX_PREFILLS  # entries of seq_lens, block tables, query starts
        self.scales = [layer.self_attn.scale for layer in model.layers]
        self._work_list = work_list
        pw, c = piecewise, caches[0]
        # tokens per prefill work item (the plan for max_query_len = T), and the most items a step
        # of T tokens and MAX_PREFILLS chunks can have
        self.tok_m = {t: prefill_plan(pw.q[:t], c.k, t, None, pw.k[:t], pw.v[:t])["tok_m"] for t in self.token_buckets}
        self.work_size = {t: -(-t // self.tok_m[t]) + MAX_PREFILLS for t in self.token_buckets}
        S, T = self.num_seqs, self.max_tokens
        # device buffer, bytes: int32 [seq_lens (S) | query starts (S + 1) | work] | int64 [3 x S
        # (logit rows, pending rows' positions and sources)] | int64 [ids | positions | slots] (3 T)
        # | int32 block tables (rows x width, any width: copied into self.tables)
        self.m32_words = 2 * S + 1 + max(self.work_size.values())
        self.ext_at = -(-self.m32_words * 4 // 16) * 16
        self.io_at = self.ext_at + 3 * S * 8
        self.tables_at = self.io_at + 3 * T * 8
        size = self.tables_at + S * max_blocks_per_seq * 4
        self.stage = torch.zeros(size, dtype=torch.uint8, device=device)
        self.tables = torch.zeros((S, max_blocks_per_seq), dtype=torch.int32, device=device)
        m32 = self.stage[:self.m32_words * 4].view(torch.int32)
        self.seq_lens, self.query_starts, self.work = m32[:S], m32[S:2 * S + 1], m32[2 * S + 1:]
        self.seq_lens.fill_(1)  # decode padding rows: one token of block 0
        self.ext = self.stage[self.ext_at:self.io_at].view(torch.int64)
        self.io = self.stage[self.io_at:self.tables_at].view(torch.int64)
        self._uploads = UploadRing(size)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool_bytes = 0  # what capturing added to the shared pool
        self.num_runs = 0

    @property
    def static_bytes(self) -> int:
        return self.stage.numel() + self.tables.numel() * 4

    def _inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, positions, slots of bucket t: views at fixed places of the stage."""
        return self.io[:t], self.io[t:2 * t], self.io[2 * t:3 * t]

    def _forward(self, rows: int, t: int) -> None:
        """The model over t rows with `rows` decode rows (see the module docstring) -> buf.hidden[:t]."""
        m, ops, b = self.model, self.ops, self.pw.buf
        ids, positions, slots = self._inputs(t)
        cfg = m.cfg
        x, residual = m.embed_tokens(ids), None
        for i, layer in enumerate(m.layers):
            h, residual = layer.input_norm(ops, x, residual)
            q, k, v = layer.self_attn.project(ops, h, out=b.qkv[:t])
            q, k = rotate_and_store(ops, q, k, v, positions, m.cos_sin, self.caches[i], slots)
            out = b.attn_out[:t]
            attend_fixed(ops, q, k, v, self.caches[i], self.scales[i], rows, self.tables, self.seq_lens,
                         self.query_starts, self.work[:self.work_size[t]], out.view(t, cfg.num_heads, cfg.head_dim))
            x, residual = layer.finish(ops, out, residual)
        x, _ = m.comm.reduce_norm(ops, x, residual, m.norm.weight, m.norm.eps)
        b.hidden[:t].copy_(x)

    def _shapes(self, largest_first: bool = True) -> Iterator[tuple[int, int]]:
        """Every (R, T) to capture, with the inputs of T set as each T comes: token 0 at position 0
        on every row, written nowhere (slot -1; the buckets' views overlap, so only T's are right)."""
        from kernels.prefill_attention import WORK_PAD

        self.work.fill_(WORK_PAD)
        order = -1 if largest_first else 1
        for t in self.token_buckets[::order]:
            ids, positions, slots = self._inputs(t)
            ids.zero_()
            positions.zero_()
            slots.fill_(-1)
            for rows in self.decode_rows[::order]:
                if rows <= t:
                    yield rows, t

    @torch.inference_mode()
    def dry_run(self) -> None:
        """Inside kernels.launch.compile_ahead(): a forward for each token count and for each decode
        row count, smallest first (the graphs' (R, T) pairs would cost seconds of forwards; a variant
        this misses compiles at capture)."""
        seen_t: set[int] = set()
        seen_rows: set[int] = set()
        for rows, t in self._shapes(largest_first=False):
            if t not in seen_t or rows not in seen_rows:
                seen_t.add(t)
                seen_rows.add(rows)
                self._forward(rows, t)

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Every (R, T) graph, into `pool` (the piecewise graphs'): their temporaries fit in it."""
        pw = self.pw
        torch.cuda.empty_cache()  # as in PiecewiseGraphs.capture: measure the pool's growth only
        before = torch.cuda.memory_reserved(pw.device)
        seen_t: set[int] = set()
        seen_rows: set[int] = set()
        for rows, t in self._shapes():
            # an eager warm-up (kernels compiled and loaded, cuBLAS's choices made) for each token
            # count and each row count once, not per (R, T) pair (101 of them for the 8B): most
            # variants follow from one or the other; a variant met first in a capture loads there
            warm = t not in seen_t or rows not in seen_rows
            if warm:
                seen_t.add(t)
                seen_rows.add(rows)
                self._forward(rows, t)
                torch.cuda.synchronize(pw.device)
            mode = "global" if warm else "thread_local"
            self.graphs[(rows, t)] = capture_graph(lambda: self._forward(rows, t), pool, mode)[0]
        torch.cuda.synchronize(pw.device)
        torch.cuda.empty_cache()  # the eager warm-ups' memory
        self.pool_bytes = max(0, torch.cuda.memory_reserved(pw.device) - before)
        log.info("captured %d step graphs (%d..%d tokens, up to %d decodes) in the piecewise pool (+%.1f MiB) "
                 "+ %.1f MiB of static buffers", len(self.graphs), self.token_buckets[0], self.max_tokens,
                 self.decode_rows[-1], self.pool_bytes / 2**20, self.static_bytes / 2**20)

    def key(self, num_decode: int, num_prefills: int, num_tokens: int) -> tuple[int, int] | None:
        """The graph for a step of num_decode decodes first, then num_prefills chunks, num_tokens in
        all, or None when none fits (too many tokens or chunks; work_size bounds the work items)."""
        if not 0 < num_prefills <= MAX_PREFILLS:
            return None
        rows = smallest_bucket(self.decode_rows, num_decode)  # next power of two (1 for none)
        if rows is None:
            return None
        t = smallest_bucket(self.token_buckets, max(num_tokens, rows))
        return (rows, t) if (rows, t) in self.graphs else None

    def run(self, key: tuple[int, int], host: HostInputs, num_decode: int, num_seqs: int,
            samples: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Upload one step's inputs (the runner's, engine/runner.py _mixed_inputs) in the graph's
        layout and replay its graph. samples: the previous step's tokens where pending inputs come
        from. -> (final hidden states [T, hidden], logit rows)."""
        rows, t = key
        i64, i32, width = host.i64, host.i32, host.width
        nd, n, S = num_decode, host.num_tokens, self.num_seqs
        npf = num_seqs - nd
        buf = self._uploads.buffer()
        m32 = buf[:self.m32_words * 4].view(np.int32)
        m32[:nd] = i32[:nd]
        m32[nd:rows] = 1
        m32[rows:rows + npf] = i32[nd:num_seqs]
        qsl = i32[num_seqs + nd:2 * num_seqs + 1]  # the chunks' starts and the end: rows of q
        m32[S + rows:S + rows + npf + 1] = qsl
        work = self._work_list(list(range(rows, rows + npf)), np.diff(qsl).tolist(), self.tok_m[t], self.work_size[t])
        assert work is not None, "more work items than work_size allows"
        m32[2 * S + 1:2 * S + 1 + len(work)] = work
        extra = len(i64) - 3 * n
        buf[self.ext_at:self.ext_at + extra * 8].view(np.int64)[:] = i64[3 * n:]
        io = buf[self.io_at:self.io_at + 3 * t * 8].view(np.int64)
        for part, fill in enumerate((0, 0, -1)):  # ids, positions, slots; padding rows write nowhere
            io[part * t:part * t + n] = i64[part * n:(part + 1) * n]
            io[part * t + n:(part + 1) * t] = fill
        tables_at = self.io_at + 3 * t * 8
        n_rows = rows + npf
        tables = buf[tables_at:tables_at + n_rows * width * 4].view(np.int32).reshape(n_rows, width)
        src = i32[host.head:].reshape(num_seqs, width)
        tables[:nd] = src[:nd]
        tables[nd:rows] = 0
        tables[rows:] = src[nd:]
        self._uploads.send(self.stage, tables_at + n_rows * width * 4)
        self.tables[:n_rows, :width].copy_(self.stage[tables_at:tables_at + n_rows * width * 4]
                                          .view(torch.int32).view(n_rows, width))
        ext = self.ext[:extra]
        num_logits = host.num_logits
        if host.num_pending:
            assert samples is not None
            take_pending(self.io[:t], ext[num_logits:], host.num_pending, samples)
        self.graphs[key].replay()
        self.num_runs += 1
        return self.pw.buf.hidden[:t], ext[:num_logits]
