"""Attention metadata (built by the runner each step) and the op sets the model calls.

The model receives an Ops object and an AttnMetadata as arguments; nothing is global.
Batches put decode tokens (one new token per sequence) first, so decode attention runs on the
first num_decode rows and prefill attention on the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kernels import moe_reference, reference
from kvcache.pool import LayerCache


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 = skip
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decode: int  # the first num_decode sequences have exactly one new token
    max_query_len: int
    # query_start_loc[num_decode:] - num_decode: the prefill part's own starts (mixed steps; the
    # runner uploads it with the rest, else each layer computes it)
    prefill_query_start_loc: torch.Tensor | None = None
    # attention launches planned by the step's first layer, relaunched by the others (Ops.reuse)
    launches: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable
    apply_rotary: Callable
    # (x, gate_up weight [2I, K], prefetch=False) -> silu(x @ gate.T) * (x @ up.T); prefetch: the
    # kernel before is a cross-GPU sum that leaves the memory idle (kernels/gate_up.py)
    gate_up_silu: Callable
    write_kv_cache: Callable
    decode_attention: Callable  # (q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, out=)
    # (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale, out=):
    # apply_rotary, the KV write and decode_attention at once (unquantized pages, decode-only steps)
    rotary_decode_attention: Callable
    # (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, max_query_len,
    #  k=, v=, out=): k, v are this step's new keys/values (already in the pages), which the kernel may
    #  read instead of the pages for the new-token part; out= a view to write the result into
    prefill_attention: Callable
    linear: Callable  # (x, weight, bias=None, out=None) -> x @ weight.T + bias
    argmax_rows: Callable  # (logits [N, V], out=None) -> int64 [N]: greedy tokens, the first max of a row
    # the attention ops take reuse= (kernels/paged_attention.py): one step's layers share a launch plan
    reuse: bool = False
    # prefill_attention takes work= (a fixed grid over a work list): whole-step graphs (engine/step_graph.py)
    work_lists: bool = False
    # (x, w13, w2, topk_weights, topk_ids, expert_start, num_global_experts) -> [T, hidden]: the
    # experts of a mixture-of-experts layer (kernels/moe_reference.py)
    fused_moe: Callable = moe_reference.fused_moe
    # (logits [N, V] of vocabulary entries offset.., offset) -> int64 [N] keys whose maximum over the
    # tensor-parallel ranks holds the greedy token (kernels/argmax.py)
    argmax_keys: Callable = reference.argmax_keys
    # (x, weight FP8 [N, K], weight_scale, bias=None, out=None) -> x @ dequantized weight.T + bias, x
    # quantized per token (kernels/fp8.py); and the MLP's activation with an FP8 gate_up weight
    fp8_linear: Callable = reference.fp8_linear
    fp8_gate_up_silu: Callable = reference.fp8_gate_up_silu
    # (x, weight int32 [N, K/8], weight_scale, weight_zero, bias=None, out=None, order=None) -> x @ the
    # 4-bit weight dequantized .T + bias, x's columns in `order` where its groups are in activation
    # order (kernels/int4.py); and the MLP's activation with a 4-bit gate_up weight
    int4_linear: Callable = reference.int4_linear
    int4_gate_up_silu: Callable = reference.int4_gate_up_silu
    # x [T, 2I] (gate then up) -> silu(gate) * up [T, I]: the MLP's activation after a gate_up
    # projection that LoRA adapters add to (engine/lora.py)
    silu_and_mul: Callable = reference.silu_and_mul


def _reference_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                       k_scale=None, v_scale=None, max_query_len=None, k=None, v=None, out=None):
    # k, v are the pages' own values for the new tokens: the reference reads everything from the pages
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     scale, k_scale, v_scale, out)


def _reference_gate_up(x, weight, prefetch=False):
    return reference.gate_up_silu(x, weight)


def reference_ops() -> Ops:
    return Ops(reference.rms_norm, reference.apply_rotary, _reference_gate_up,
               reference.write_kv_cache, reference.paged_decode_attention, reference.rotary_decode_attention,
               _reference_prefill, reference.linear, reference.argmax_rows)


def rotate_and_store(ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, layer_cache: LayerCache,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q, k, then this step's k, v into the pages -> (q, k) as attention must
    see them. Unquantized pages take both in one kernel."""
    c = layer_cache
    if c.plain:
        return ops.apply_rotary(q, k, positions, cos_sin, v, c.k, c.v, slot_mapping)
    q, k = ops.apply_rotary(q, k, positions, cos_sin)
    return store_kv(ops, q, k, v, c, slot_mapping)


def store_kv(ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: LayerCache,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write this step's k, v into the pages -> (q, k) as attention must see them. An fp8/int8
    cache holds K rotated: q and k are rotated first (kvcache/rotation.py), which leaves every q.k,
    hence the output, unchanged (attention scales by score_scale); and the write picks each key's
    scale with the same token's (rotated) queries (kvcache/quant.py)."""
    c = layer_cache
    if c.rotation is not None:
        q, k = c.rotation.apply(q, k)
    ops.write_kv_cache(k, v, c.k, c.v, slot_mapping, c.k_scale, c.v_scale, c.kv_dtype, q=q)  # unquantized: q unused
    return q, k


def attend(ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: LayerCache,
           meta: AttnMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the pages, which already hold this step's k, v: q [T, H, D] -> [T, H, D]
    (into `out` when given). Prefill also gets k, v themselves: the same values as the pages now
    hold for the new tokens, contiguous."""
    c = layer_cache
    if c.rotation is not None:
        scale = scale * c.rotation.score_scale
    nd = meta.num_decode
    num_seqs = meta.seq_lens.shape[0]
    kw = {"reuse": meta.launches} if ops.reuse else {}
    if nd == num_seqs:
        return ops.decode_attention(q, c.k, c.v, meta.block_tables, meta.seq_lens, scale, c.k_scale, c.v_scale,
                                    out=out, **kw)
    if nd == 0:
        return ops.prefill_attention(q, c.k, c.v, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     scale, c.k_scale, c.v_scale, meta.max_query_len, k=k, v=v, out=out, **kw)
    # Mixed step: both kernels write their rows of one output (no copies). Eager steps run these
    # lines once per layer, so every host microsecond here counts (bench/NOTES.md).
    if out is None:
        out = torch.empty_like(q)
    d, p = _mixed_parts(q, k, v, out, meta)
    ops.decode_attention(d[0], c.k, c.v, d[1], d[2], scale, c.k_scale, c.v_scale, out=d[3], **kw)
    ops.prefill_attention(p[0], c.k, c.v, p[1], p[2], p[3], scale, c.k_scale, c.v_scale, meta.max_query_len,
                          k=p[4], v=p[5], out=p[6], **kw)
    return out


def attend_fixed(ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: LayerCache, scale: float,
                 rows: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_starts: torch.Tensor,
                 work: torch.Tensor, out: torch.Tensor) -> None:
    """attend() on grids fixed by shapes alone, for a whole-step CUDA graph (engine/step_graph.py):
    decode attention over the first `rows` rows of q (entries 0.. of seq_lens and block_tables),
    then prefill attention over the work list's items, whose sequence entries hold query starts
    that are rows of q itself; it overwrites whatever decode attention wrote to its rows."""
    c = layer_cache
    if c.rotation is not None:
        scale = scale * c.rotation.score_scale
    ops.decode_attention(q[:rows], c.k, c.v, block_tables[:rows], seq_lens[:rows], scale, c.k_scale, c.v_scale,
                         out=out[:rows])
    ops.prefill_attention(q, c.k, c.v, block_tables, seq_lens, query_starts, scale, c.k_scale, c.v_scale,
                          q.shape[0], k=k, v=v, out=out, work=work)


def _mixed_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 meta: AttnMetadata) -> tuple[tuple, tuple]:
    """A mixed step's views for decode attention (q, block tables, seq_lens, out) and prefill
    attention (q, block tables, seq_lens, query starts, k, v, out), made once per step when every
    layer passes the same q, k, v, out (piecewise graphs' buffers): the same objects each layer
    let the kernels' relaunch skip checking them (kernels/launch.py Bound)."""
    hit = meta.launches.get("parts")
    if hit is not None and hit[0] is q and hit[1] is k and hit[2] is v and hit[3] is out:
        return hit[4], hit[5]
    nd = meta.num_decode
    qsl = meta.prefill_query_start_loc
    if qsl is None:
        qsl = meta.query_start_loc[nd:] - nd
    d = (q[:nd], meta.block_tables[:nd], meta.seq_lens[:nd], out[:nd])
    p = (q[nd:], meta.block_tables[nd:], meta.seq_lens[nd:], qsl, k[nd:], v[nd:], out[nd:])
    meta.launches["parts"] = (q, k, v, out, d, p)
    return d, p


def paged_attention(ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, layer_cache: LayerCache, meta: AttnMetadata,
                    scale: float) -> torch.Tensor:
    """Rotary embedding, this step's k, v into the pages, then attention: q [T, H, D] -> [T, H, D]."""
    c = layer_cache
    if c.plain and meta.num_decode == meta.seq_lens.shape[0]:
        kw = {"reuse": meta.launches} if ops.reuse else {}
        return ops.rotary_decode_attention(q, k, v, positions, cos_sin, c.k, c.v, meta.slot_mapping,
                                           meta.block_tables, meta.seq_lens, scale, **kw)
    q, k = rotate_and_store(ops, q, k, v, positions, cos_sin, layer_cache, meta.slot_mapping)
    return attend(ops, q, k, v, layer_cache, meta, scale)
