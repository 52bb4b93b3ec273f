"""The sparse mixture-of-experts block of Qwen3-MoE, Mixtral and Qwen2-MoE: a router and E experts
(and Qwen2-MoE's shared expert: a dense MLP every token takes, its output scaled by a sigmoid gate).

The router (a [E, hidden] weight, whole on every rank) picks each token's top-k experts from a
softmax over all of them; Ops.fused_moe runs the experts (kernels/moe.py on a GPU, the torch
reference on the CPU). Experts are stacked: w13 [E, 2I, hidden] (gate rows, then up rows, as the
dense MLP's gate_up) and w2 [E, hidden, I]; the loader fills them expert by expert.

Tensor parallel: every rank holds a slice of every expert's width (I / ranks), like the dense MLP;
with expert parallelism each rank holds E / ranks whole experts instead, and computes their part of
every token's output (tokens are the same on every rank). Either way the ranks' partial outputs
are summed by the all-reduce that the dense MLP's down projection uses.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import Ops
from engine.config import ModelConfig
from engine.parallel.comm import Comm
from engine.parallel.layers import Segment, Shard, even_split
from kernels.moe_reference import route

# Hugging Face tensor names of one expert's projections, gate/up/down, by architecture
EXPERT_NAMES = {"Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "Qwen2MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2")}


@dataclass(frozen=True)
class ExpertShard:
    """Which experts a rank holds (a range of the model's), and the slice of each expert's 2-D
    Hugging Face tensor it holds (inner: a Shard of that tensor, gate and up as two segments)."""
    experts: Segment
    inner: Shard

    def global_shape(self, local: torch.Size) -> list[int]:
        shape = [self.experts.global_size, *local[1:]]
        shape[1 + self.inner.dim] = self.inner.global_size
        return shape

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's part of the stacked global tensor [E, ...]."""
        mine = full.narrow(0, self.experts.start, self.experts.length)
        return torch.stack([self.inner.take(w) for w in mine]) if self.inner.local_size < self.inner.global_size else mine


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, expert_parallel: bool) -> None:
        super().__init__()
        e, width, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if expert_parallel:
            experts, part = even_split(e, comm.rank, comm.size), Segment(width, 0, width)
        else:
            experts, part = Segment(e, 0, e), even_split(width, comm.rank, comm.size)
        self.expert_start, self.num_global = experts.start, e
        self.w13 = nn.Parameter(torch.empty(experts.length, 2 * part.length, h))
        self.w2 = nn.Parameter(torch.empty(experts.length, h, part.length))
        self.stacked_shards = {"w13": ExpertShard(experts, Shard(0, (part, part))),
                              "w2": ExpertShard(experts, Shard(1, (part,)))}


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, expert_parallel: bool,
                 shared: Callable[[int], nn.Module] | None = None) -> None:
        """shared(width): the dense MLP of Qwen2-MoE's shared expert (each rank a slice of its width)."""
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob or cfg.architecture == "MixtralForCausalLM"
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg, comm, expert_parallel)
        self.shared_expert = shared(cfg.shared_expert_size) if shared is not None and cfg.shared_expert_size else None
        self.shared_expert_gate = Router(1, cfg.hidden_size) if self.shared_expert is not None else None

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(ops.linear(x, self.gate.weight), self.top_k, self.renormalize)
        ex = self.experts
        # this rank's part of the output (its experts' or its columns' share): the norm after sums it
        out = ops.fused_moe(x, ex.w13, ex.w2, weights, ids, ex.expert_start, ex.num_global)
        if self.shared_expert is not None:  # its part too (a slice of its width), scaled by the whole gate
            # one output column: through torch (cuBLAS), not the skinny kernel, which no test runs that narrow
            gate = torch.sigmoid(torch.nn.functional.linear(x, self.shared_expert_gate.weight).float()).to(out.dtype)
            out = out + gate * self.shared_expert(ops, x)
        return out


def expert_weight_map(cfg: ModelConfig, block: SparseMoeBlock, hf_layer: str,
                      ours: str) -> dict[str, tuple[str, int, int] | None]:
    """Hugging Face tensor name -> (our stacked parameter, this rank's expert index, segment of its
    inner shard), or None for another rank's expert, for one layer's experts (hf_layer:
    "model.layers.{i}.", ours: "layers.{j}.mlp.")."""
    prefix, gate, up, down = EXPERT_NAMES[cfg.architecture]
    ex = block.experts
    start, count = ex.expert_start, ex.w13.shape[0]
    m: dict[str, tuple[str, int, int] | None] = {}
    for e in range(cfg.num_experts):
        mine = start <= e < start + count
        base = f"{hf_layer}{prefix}.experts.{e}."
        for name, param, seg in ((gate, "w13", 0), (up, "w13", 1), (down, "w2", 0)):
            m[f"{base}{name}.weight"] = (f"{ours}experts.{param}", e - start, seg) if mine else None
    return m


def router_weight_name(cfg: ModelConfig, hf_layer: str) -> str:
    return f"{hf_layer}{EXPERT_NAMES[cfg.architecture][0]}.gate.weight"
