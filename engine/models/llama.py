"""The Llama family in one file: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), and the
mixtures of experts built on them, Qwen3-MoE and Mixtral (engine/models/moe.py's block in place of
the MLP where the config says).

q/k/v and gate/up projections are stored fused (the loader packs Hugging Face's separate
weights), so each layer runs four matmuls. Ops and attention metadata arrive as arguments.

Tensor parallel (a Comm of several ranks): the layers hold this rank's heads, MLP columns and
vocabulary rows (engine/parallel/layers.py); the embedding all-reduces its lookups, and the LM head
gathers the full vocabulary's logits. o_proj's and the MLP's outputs are this rank's parts of sums
over the ranks: the norm after each sums them (Comm.reduce_norm, one kernel with the residual add
and the norm where peer memory allows), so a layer's output x is such a part, except in a pipeline
stage's carry, which holds the sum.

Pipeline parallel (a Stage of several): the model holds only its stage's layers (numbered from 0
here, from stage.start in the checkpoint), the embedding on the first stage, the final norm and the
LM head on the last (a tied LM head there loads the checkpoint's embedding). A stage other than the
last returns its carry, the hidden state and the residual stream stacked [2, T, hidden], which the
next stage's forward takes in place of the embedding.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from engine.attention import AttnMetadata, Ops, paged_attention
from engine.config import ModelConfig
from engine.models.moe import SparseMoeBlock, expert_weight_map, router_weight_name
from engine.parallel.comm import Comm
from engine.parallel.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Shard,
                                    VocabParallelEmbedding, even_split, gather_logits, head_split, vocab_argmax,
                                    vocab_logits)
from engine.parallel.stage import Stage, whole_model
from engine.quant import Fp8Format, Int4Format, QuantizationError, WeightFormat
from kvcache.pool import LayerCache


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by factor, short ones kept, the band between interpolated.
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(cfg, rs, dim)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn are)")


def _yarn_inv_freq(cfg: ModelConfig, rs: dict, dim: int) -> torch.Tensor:
    """YaRN (Qwen2.5/Qwen3's long context): dimensions that turn many times within the original
    context keep their frequency, those that turn less than once are divided by factor, and a
    linear ramp between beta_fast and beta_slow rotations blends the two."""
    base, factor = cfg.rope_theta, float(rs["factor"])
    original = float(rs.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1: the original frequency, 0: divided by factor
    return (1 / (factor * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature (0.1 ln(factor) + 1, or its
    attention_factor / mscale form), else 1."""
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = float(rs["factor"])

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(float(rs["mscale"])) / mscale(float(rs["mscale_all_dim"]))
    return mscale()


def rope_cos_sin(cfg: ModelConfig, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """[max_positions, 2, head_dim] float32: cos and sin, duplicated over both halves."""
    inv_freq = rope_inv_freq(cfg)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rope_attention_factor(cfg)
    return torch.stack((emb.cos() * scale, emb.sin() * scale), dim=1).to(device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # the output's columns in a 4-bit projection's activation order (LlamaForCausalLM.fold_act_orders)
        self.register_buffer("order", None)


def rank_config(cfg: ModelConfig, comm: Comm) -> ModelConfig:
    """The model's shapes as one rank holds them: its Q heads, KV heads (one, replicated, where
    there are fewer than ranks) and MLP width; hidden size and vocabulary stay global."""
    if comm.size == 1:
        return cfg
    kv = head_split(cfg.num_kv_heads, cfg.head_dim, comm.rank, comm.size).length // cfg.head_dim
    return replace(cfg, num_heads=cfg.num_heads // comm.size, num_kv_heads=kv,
                   intermediate_size=cfg.intermediate_size // comm.size)


def project(ops: Ops, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ layer's weight.T (+ its bias): a 16-bit weight by ops.linear, an FP8 one by
    ops.fp8_linear, a 4-bit one by ops.int4_linear; plus each token's LoRA adapter's part
    (engine/lora.py) where the layer has adapters."""
    bias = getattr(layer, "bias", None)
    if layer.weight_scale is None:
        y = ops.linear(x, layer.weight, bias, out=out)
    elif layer.weight_zero is not None:
        y = ops.int4_linear(x, layer.weight, layer.weight_scale, layer.weight_zero, bias, out=out,
                            order=layer.weight_perm)
    else:
        y = ops.fp8_linear(x, layer.weight, layer.weight_scale, bias, out=out)
    if layer.lora is not None:
        layer.lora.add_delta(x, y)
    return y


def _order_into_norm(layer: nn.Module, norm: RMSNorm) -> None:
    if layer.weight_perm is not None:
        norm.order, layer.weight_perm = layer.weight_perm, None


def _permute_outputs(gate_up: nn.Module, order: torch.Tensor) -> None:
    """A 4-bit gate_up weight's rows (and their scales and zero points) reordered so that
    silu(gate) * up comes out with its columns in `order`: gate's rows and up's each by it."""
    assert gate_up.weight_zero is not None, "an act-order down projection after a 4-bit gate/up"
    rows = torch.cat((order, order + len(order)))
    gate_up.weight.copy_(gate_up.weight.index_select(0, rows))
    gate_up.weight_scale.copy_(gate_up.weight_scale.index_select(1, rows))
    gate_up.weight_zero.copy_(gate_up.weight_zero.index_select(1, rows))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, quant: WeightFormat | None = None) -> None:
        super().__init__()
        q_part = head_split(cfg.num_heads, cfg.head_dim, comm.rank, comm.size)
        kv_part = head_split(cfg.num_kv_heads, cfg.head_dim, comm.rank, comm.size)
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = q_part.length, kv_part.length
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_part, kv_part, kv_part], cfg.attention_bias, quant)
        self.o_proj = RowParallelLinear(q_part, cfg.hidden_size, quant)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(self, ops: Ops, x: torch.Tensor,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D] before the rotary embedding (which
        engine/attention.py applies with the KV write); views of one qkv tensor (`out`
        [T, q + 2 kv] when given: the piecewise CUDA graphs' static buffer)."""
        t = x.shape[0]
        qkv = project(ops, self.qkv_proj, x, out=out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q_buf, k_buf = q, k
        if self.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.q_norm.eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.k_norm.eps).view_as(k)
        if out is not None and q is not q_buf:  # keep q and k in the static buffer
            q_buf.copy_(q)
            k_buf.copy_(k)
            q, k = q_buf, k_buf
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, quant: WeightFormat | None = None, width: int | None = None) -> None:
        super().__init__()
        part = even_split(width or cfg.intermediate_size, comm.rank, comm.size)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [part, part], False, quant)
        self.down_proj = RowParallelLinear(part, cfg.hidden_size, quant, by_group=True)
        self.comm = comm

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        """-> this rank's part of the output (a sum over the ranks)."""
        # after the fused cross-GPU sum the gate/up kernel pulls its first weights into L2 meanwhile
        gate_up = self.gate_up_proj
        if gate_up.lora is not None:  # the adapters' part joins before the activation
            h = ops.silu_and_mul(project(ops, gate_up, x))
        elif gate_up.weight_zero is not None:
            h = ops.int4_gate_up_silu(x, gate_up.weight, gate_up.weight_scale, gate_up.weight_zero,
                                      order=gate_up.weight_perm)
        elif gate_up.weight_scale is not None:
            h = ops.fp8_gate_up_silu(x, gate_up.weight, gate_up.weight_scale)
        else:
            h = ops.gate_up_silu(x, gate_up.weight, prefetch=self.comm.fused_sums)
        return project(ops, self.down_proj, h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, layer: int = 0, expert_parallel: bool = False,
                 quant: WeightFormat | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, comm, quant)
        self.mlp = (SparseMoeBlock(cfg, comm, expert_parallel, lambda width: MLP(cfg, comm, None, width))
                    if cfg.is_moe_layer(layer) else MLP(cfg, comm, quant))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.comm = comm

    def input_norm(self, ops: Ops, x: torch.Tensor, residual: torch.Tensor | None,
                   summed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input RMSNorm (adding x to the residual stream) -> (normed, residual). x: the
        embedding (residual None) or the layer before's output, each a part of a sum over the
        ranks, unless summed (a pipeline stage's carry)."""
        ln = self.input_layernorm
        if summed:
            return ops.rms_norm(x, ln.weight, ln.eps, residual, order=ln.order)
        return self.comm.reduce_norm(ops, x, residual, ln.weight, ln.eps, ln.order)

    def finish(self, ops: Ops, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output [T, q_size] -> o_proj, post-attention RMSNorm, MLP -> (x, residual), x
        this rank's part of the MLP's output."""
        h = project(ops, self.self_attn.o_proj, attn_out)
        ln = self.post_attention_layernorm
        h, residual = self.comm.reduce_norm(ops, h, residual, ln.weight, ln.eps, ln.order)
        return self.mlp(ops, h), residual

    def forward(self, ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, cache: LayerCache, meta: AttnMetadata,
                summed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm(ops, x, residual, summed)
        attn = self.self_attn
        q, k, v = attn.project(ops, h)
        o = paged_attention(ops, q, k, v, positions, cos_sin, cache, meta, attn.scale)
        return self.finish(ops, o.reshape(x.shape[0], attn.q_size), residual)


class LlamaForCausalLM(nn.Module):
    """cfg: the whole model's config. self.cfg is this rank's view of it (rank_config), which the
    graphs' static buffers are shaped by; self.global_cfg the whole model's. expert_parallel: the
    MoE layers' experts are split over the tensor-parallel ranks (engine/models/moe.py)."""

    def __init__(self, cfg: ModelConfig, comm: Comm | None = None, stage: Stage | None = None,
                 expert_parallel: bool = False, quant: WeightFormat | None = None) -> None:
        super().__init__()
        self.comm = comm = comm or Comm()
        self.stage = stage = stage or whole_model(cfg.num_layers)
        self.expert_parallel = expert_parallel
        if quant is not None and cfg.num_experts:
            raise QuantizationError(f"{quant.label} weights for {cfg.architecture} (a mixture of experts) are not "
                                    "supported yet; serve its 16-bit checkpoint")
        self.quant = quant
        self.global_cfg = cfg
        self.cfg = rank_config(cfg, comm)
        # the parameters are left empty (no normal_ init, which imports torch._dynamo and with it
        # triton wherever that is installed); the loader fills every weight
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm) if stage.first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, comm, i, expert_parallel, quant)
                                    for i in range(stage.start, stage.end))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.last else None
        own_head = stage.last and not (cfg.tie_word_embeddings and stage.first)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm) if own_head else None
        self.cos_sin: torch.Tensor | None = None  # [max_positions, 2, head_dim], set by the runner

    def forward(self, ops: Ops, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttnMetadata, logit_indices: torch.Tensor | None, carry: torch.Tensor | None = None,
                gather: bool = True) -> torch.Tensor:
        """input_ids, positions [T] -> logits [len(logit_indices), vocab] in the model's dtype (with
        gather=False this rank's part of the vocabulary: greedy_tokens, gather_logits), or with
        logit_indices None the final hidden states [T, hidden] (compute_logits takes rows of them); a
        pipeline stage after the first reads carry (the last stage's output) instead of input_ids, and a
        stage before the last returns its carry [2, T, hidden] instead of logits."""
        if self.embed_tokens is not None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = carry[0], carry[1]
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x, residual = layer(ops, x, residual, positions, self.cos_sin, cache, meta, summed=i == 0 and carry is not None)
        if self.norm is None:
            return torch.stack((self.comm.all_reduce(x), residual))
        x, _ = self.comm.reduce_norm(ops, x, residual, self.norm.weight, self.norm.eps)
        return x if logit_indices is None else self.compute_logits(x[logit_indices], gather)

    @torch.no_grad()
    def fold_act_orders(self) -> None:
        """Moves 4-bit weights' activation orders (weight_perm) out of the forward's gathers, once
        the weights are loaded: q/k/v's and gate/up's into the RMSNorm before them, which writes its
        output in that order; down's into gate/up's output rows, so that h comes out in down's
        order. o's input comes from attention and keeps its gather. One rank only: under tensor
        parallelism the cross-GPU sum is fused with the norm, and q/k/v and gate/up keep their
        gathers (the loader has chosen gate/up's rows in down's order: engine/loader.py)."""
        if self.comm.size > 1:
            return
        for layer in self.layers:
            _order_into_norm(layer.self_attn.qkv_proj, layer.input_layernorm)
            if isinstance(layer.mlp, MLP):
                gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
                _order_into_norm(gate_up, layer.post_attention_layernorm)
                if down.weight_perm is not None:
                    _permute_outputs(gate_up, down.weight_perm)
                    down.weight_perm = None

    @property
    def _head(self) -> nn.Module:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, h: torch.Tensor, gather: bool = True) -> torch.Tensor:
        # in the model's dtype: greedy rows take the argmax as is (the same token as in float32);
        # the sampler converts for the rows and logprobs that need float32
        return vocab_logits(h, self._head.weight, self.comm, self.global_cfg.vocab_size, gather)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """compute_logits(gather=False)'s logits -> the whole vocabulary's, on every rank."""
        return gather_logits(logits, self.comm, self.global_cfg.vocab_size)

    def greedy_tokens(self, ops: Ops, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """compute_logits(gather=False)'s logits -> every row's greedy token into out [N]."""
        head = self._head
        return vocab_argmax(ops, logits, self.comm, head.start, head.num_valid, out)

    def held_elsewhere(self, hf_name: str) -> bool:
        """Whether a checkpoint tensor belongs to another pipeline stage (the loader skips it)."""
        stage = self.stage
        if stage.size == 1:
            return False
        if hf_name.startswith("model.layers."):
            return not stage.owns_layer(int(hf_name.split(".")[2]))
        if hf_name == "model.embed_tokens.weight":
            return not stage.first and not (stage.last and self.global_cfg.tie_word_embeddings)
        return hf_name in ("model.norm.weight", "lm_head.weight") and not stage.last

    def param_shards(self) -> dict[str, Shard]:
        """Our parameter name -> how this rank's tensor is cut from the global one; parameters
        not listed are whole on every rank (norms)."""
        return {f"{mod}.{name}" if mod else name: m.shard for mod, m in self.named_modules() if hasattr(m, "shard")
                for name, _ in m.named_parameters(recurse=False)}

    def expert_shards(self) -> dict:
        """Our stacked expert parameter name -> its ExpertShard (engine/models/moe.py)."""
        return {f"{mod}.{name}": shard for mod, m in self.named_modules() if hasattr(m, "stacked_shards")
                for name, shard in m.stacked_shards.items()}

    def hf_expert_map(self) -> dict[str, tuple[str, int, int] | None]:
        """Hugging Face expert tensor name -> (our stacked parameter, this rank's expert index, the
        segment of its inner shard), or None for an expert another rank holds."""
        m: dict[str, tuple[str, int, int] | None] = {}
        for i in range(self.stage.start, self.stage.end):
            block = self.layers[i - self.stage.start].mlp
            if isinstance(block, SparseMoeBlock):
                m.update(expert_weight_map(self.global_cfg, block, f"model.layers.{i}.", f"layers.{i - self.stage.start}.mlp."))
        return m

    def hf_weight_map(self) -> dict[str, tuple[str, int | None]]:
        """Hugging Face tensor name -> (our parameter name, the segment of its shard the tensor is,
        e.g. 1 for k_proj in qkv_proj); None: the tensor is the whole parameter (not sharded)."""
        cfg, stage = self.global_cfg, self.stage
        m: dict[str, tuple[str, int | None]] = {}
        if stage.first:
            m["model.embed_tokens.weight"] = ("embed_tokens.weight", 0)
        if stage.last:
            m["model.norm.weight"] = ("norm.weight", None)
        if self.lm_head is not None:  # a tied head on a later stage than the embedding loads the embedding
            m["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"] = ("lm_head.weight", 0)
        for i in range(stage.start, stage.end):
            hf, our = f"model.layers.{i}.", f"layers.{i - stage.start}."
            for seg, part in enumerate(("q_proj", "k_proj", "v_proj")):
                m[hf + f"self_attn.{part}.weight"] = (our + "self_attn.qkv_proj.weight", seg)
                if cfg.attention_bias:
                    m[hf + f"self_attn.{part}.bias"] = (our + "self_attn.qkv_proj.bias", seg)
            if cfg.is_moe_layer(i):  # the experts: hf_expert_map
                m[router_weight_name(cfg, hf)] = (our + "mlp.gate.weight", None)
                if cfg.shared_expert_size:
                    m[hf + "mlp.shared_expert.gate_proj.weight"] = (our + "mlp.shared_expert.gate_up_proj.weight", 0)
                    m[hf + "mlp.shared_expert.up_proj.weight"] = (our + "mlp.shared_expert.gate_up_proj.weight", 1)
                    m[hf + "mlp.shared_expert.down_proj.weight"] = (our + "mlp.shared_expert.down_proj.weight", 0)
                    m[hf + "mlp.shared_expert_gate.weight"] = (our + "mlp.shared_expert_gate.weight", None)
            else:
                m[hf + "mlp.gate_proj.weight"] = (our + "mlp.gate_up_proj.weight", 0)
                m[hf + "mlp.up_proj.weight"] = (our + "mlp.gate_up_proj.weight", 1)
                m[hf + "mlp.down_proj.weight"] = (our + "mlp.down_proj.weight", 0)
            m[hf + "self_attn.o_proj.weight"] = (our + "self_attn.o_proj.weight", 0)
            for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                m[hf + name] = (our + name, None)
            if cfg.qk_norm:
                for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                    m[hf + name] = (our + name, None)
        q = self.quant
        if isinstance(q, Fp8Format) and not q.at_load:  # each FP8 weight's scale beside it
            m.update({hf[:-len("weight")] + q.scale_name: (ours + "_scale", seg) for hf, (ours, seg) in list(m.items())
                      if ours.endswith("proj.weight")})
        elif isinstance(q, Int4Format):  # a 4-bit projection's packed values, scales and zero points
            for hf, (ours, seg) in list(m.items()):
                if ours.endswith("proj.weight"):
                    del m[hf]
                    for name, suffix in zip(q.tensor_names(), ("", "_scale", "_zero")):
                        if name:
                            m[hf[:-len("weight")] + name] = (ours + suffix, seg)
        return m
