"""Piecewise CUDA graphs for the steps that carry prefill tokens (mixed and prefill-only steps).

Launched eagerly, such a step costs 17-36 ms of host time for Qwen2.5-0.5B on the H100 machine
(bench/NOTES.md), more than its GPU time: every kernel of every layer is a Python launch. Attention
depends on the batch's layout (which rows decode, the chunks and their lengths), so it stays eager;
everything between two attentions is captured, per token-count bucket T, as L + 1 graphs:

    piece 0:  embedding; layer 0's input norm, qkv projection, rotary, KV write
    piece i:  layer i-1's o_proj, post-attention norm and MLP; layer i's input norm ... KV write
    piece L:  the last layer's o_proj and MLP, the final norm

A step of n tokens runs in the smallest bucket T >= n: the pieces compute T rows (rows n.. are
padding: their slots are -1, so they write no KV, and nothing reads their results), attention runs
eagerly on the n real rows between them. Every tensor that crosses a piece boundary (ids,
positions, slots, qkv, attention output, residual, final hidden state) lives in a static buffer
allocated outside the graph pool, so the pool holds one piece's temporaries at a time, shared by all
pieces and buckets.

On a pipeline stage the pieces cover its layers: after the first stage piece 0 starts from the
static carry (the previous stage's hidden state and residual) instead of the embedding, and before
the last the last piece leaves the hidden state and the residual in their buffers (no final norm),
which run() returns stacked as the carry.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttnMetadata, Ops, attend, rotate_and_store
from engine.cuda_graph import capture_graph, smallest_bucket
from engine.models.llama import LlamaForCausalLM
from kvcache.pool import LayerCache

log = logging.getLogger("pagedserve")


def piecewise_buckets(max_tokens: int, skip: frozenset[int] = frozenset(), fine_above: int | None = None) -> list[int]:
    """Token counts to capture: 16 .. 512 (powers of two, then 384), every 256 above, and max_tokens,
    less those in skip (sizes a larger one computes faster: engine/cost_model.py). Above 512 tokens
    a step is compute bound, so the padding (< 256 rows) costs < 1/3 there and < 1/16 from 4096 up.
    Above fine_above (the largest step a whole-step graph takes, engine/step_graph.py), also every 64
    from 512 to 1024 and every 128 above: the sizes the prompt budget fills, so that a mixed step
    pays for no padding (a 70B at TP=2 padded its ~570-token steps to 768: 30% more a prompt token)."""
    sizes = [16, 32, 64, 128, 256, 384, 512] + list(range(768, max_tokens + 1, 256))
    if fine_above is not None:
        finer = list(range(512, 1024, 64)) + list(range(1024, max_tokens, 128))
        sizes += [s for s in finer if s > fine_above]
    return sorted({s for s in sizes if s < max_tokens and s not in skip} | {max_tokens})


@dataclass
class StaticBuffers:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 beyond the step's tokens
    qkv: torch.Tensor  # [T, q + 2 kv]
    attn_out: torch.Tensor  # [T, q]
    residual: torch.Tensor  # [T, hidden]
    hidden: torch.Tensor  # [T, hidden], the final norm's output (a stage before the last: its hidden state)
    carry: torch.Tensor | None = None  # [2, T, hidden]: a later pipeline stage's input

    @classmethod
    def allocate(cls, model: LlamaForCausalLM, max_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> "StaticBuffers":
        cfg = model.cfg
        i64 = dict(dtype=torch.int64, device=device)
        act = dict(dtype=dtype, device=device)
        carry = None if model.embed_tokens is not None else torch.zeros(2, max_tokens, cfg.hidden_size, **act)
        return cls(torch.zeros(max_tokens, **i64), torch.zeros(max_tokens, **i64), torch.full((max_tokens,), -1, **i64),
                   torch.zeros(max_tokens, cfg.q_size + 2 * cfg.kv_size, **act), torch.zeros(max_tokens, cfg.q_size, **act),
                   torch.zeros(max_tokens, cfg.hidden_size, **act), torch.zeros(max_tokens, cfg.hidden_size, **act), carry)


class PiecewiseGraphs:
    def __init__(self, model: LlamaForCausalLM, ops: Ops, caches: list[LayerCache], max_tokens: int,
                 device: torch.device, skip: frozenset[int] = frozenset(), fine_above: int | None = None) -> None:
        self.model, self.ops, self.caches = model, ops, caches
        self.buckets = piecewise_buckets(max_tokens, skip, fine_above)
        self.max_tokens = self.buckets[-1]
        self.dtype = next(model.parameters()).dtype
        self.buf = StaticBuffers.allocate(model, self.max_tokens, self.dtype, device)
        cfg = model.cfg
        qkv = self.buf.qkv
        # the views attention reads: the same memory project() writes inside the pieces
        self.q = qkv[:, :cfg.q_size].view(-1, cfg.num_heads, cfg.head_dim)
        self.k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(-1, cfg.num_kv_heads, cfg.head_dim)
        self.v = qkv[:, cfg.q_size + cfg.kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
        self.out = self.buf.attn_out.view(-1, cfg.num_heads, cfg.head_dim)
        self.scales = [layer.self_attn.scale for layer in model.layers]
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.device = device
        self.pool_bytes = 0
        self.pool = None  # the graphs' memory pool, once captured (engine/step_graph.py captures into it too)
        self.num_runs = 0

    @property
    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self.buf).values() if t is not None)

    def _piece(self, i: int, t: int) -> None:
        """Piece i over the first t rows of the static buffers (see the module docstring)."""
        m, ops, b = self.model, self.ops, self.buf
        if i == 0:
            if b.carry is None:
                x, residual = m.embed_tokens(b.input_ids[:t]), None
            else:
                x, residual = b.carry[0, :t], b.carry[1, :t]
        else:
            x, residual = m.layers[i - 1].finish(ops, b.attn_out[:t], b.residual[:t])
        if i == len(m.layers):
            if m.norm is None:  # a pipeline stage before the last: its carry out
                b.hidden[:t].copy_(m.comm.all_reduce(x))
                b.residual[:t].copy_(residual)
                return
            x, _ = m.comm.reduce_norm(ops, x, residual, m.norm.weight, m.norm.eps)
            b.hidden[:t].copy_(x)
            return
        layer = m.layers[i]
        h, residual = layer.input_norm(ops, x, residual, summed=i == 0 and b.carry is not None)
        q, k, v = layer.self_attn.project(ops, h, out=b.qkv[:t])
        qr, kr = rotate_and_store(ops, q, k, v, b.positions[:t], m.cos_sin, self.caches[i], b.slot_mapping[:t])
        if qr is not q:  # not rotated in place (reference ops, an fp8/int8 cache's rotation): attention reads the buffer
            q.copy_(qr)
            k.copy_(kr)
        b.residual[:t].copy_(residual)

    @torch.inference_mode()
    def dry_run(self) -> None:
        """Every bucket's pieces once, inside kernels.launch.compile_ahead(): their new kernels compile."""
        self.buf.slot_mapping.fill_(-1)
        for t in reversed(self.buckets):
            for i in range(len(self.model.layers) + 1):
                self._piece(i, t)

    @torch.inference_mode()
    def capture(self) -> None:
        self.buf.slot_mapping.fill_(-1)  # warm-up and capture runs write no KV
        # cached blocks of earlier work would be released by the empty_cache() below and offset the
        # pool's growth (a tiny model's pool then measured 0 bytes)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        pool = self.pool = torch.cuda.graph_pool_handle()
        n_pieces = len(self.model.layers) + 1
        for t in reversed(self.buckets):  # largest first: the others reuse its temporaries
            for i in range(n_pieces):  # warm-up: compiles kernels, picks cuBLAS algorithms
                self._piece(i, t)
            torch.cuda.synchronize(self.device)
            self.graphs[t] = [capture_graph(lambda: self._piece(i, t), pool)[0] for i in range(n_pieces)]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured piecewise graphs for %d token counts (%d..%d), %d pieces each, in %.1f MiB + %.1f MiB "
                 "of static buffers", len(self.buckets), self.buckets[0], self.max_tokens, n_pieces,
                 self.pool_bytes / 2**20, self.static_bytes / 2**20)

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
            logit_indices: torch.Tensor | None, carry: torch.Tensor | None = None) -> torch.Tensor:
        """The model's forward for a step of n <= max_tokens tokens -> logits [len(logit_indices), V],
        or with logit_indices None the final hidden states [n, hidden] (a pipeline stage: from the
        previous stage's carry, and before the last its carry out)."""
        n = input_ids.shape[0]
        t = self.bucket_for(n)
        self.num_runs += 1
        b = self.buf
        if carry is not None:
            b.carry[:, :n].copy_(carry)
        b.input_ids[:n].copy_(input_ids)
        b.positions[:n].copy_(positions)
        b.slot_mapping[:n].copy_(meta.slot_mapping)
        if t > n:
            b.slot_mapping[n:t].fill_(-1)
        q, k, v, out = self.q[:n], self.k[:n], self.v[:n], self.out[:n]
        graphs = self.graphs[t]
        graphs[0].replay()
        for i, cache in enumerate(self.caches):
            attend(self.ops, q, k, v, cache, meta, self.scales[i], out=out)
            graphs[i + 1].replay()
        if self.model.norm is None:
            return torch.stack((b.hidden[:n], b.residual[:n]))
        if logit_indices is None:
            return b.hidden[:n]
        return self.model.compute_logits(b.hidden[:n][logit_indices])
