"""LoRA adapters served beside the base model: PEFT checkpoints (adapter_config.json and
adapter_model.safetensors) in slots, written at start-up or while serving, any mix of them in one step.

Every slot's A and B of a projection are stacked into one pair of matrices, a column group per
slot (and per packed part: q|k|v, gate|up), so a step whose tokens each use an adapter of their
own, or none, costs two dense matmuls per projection: h = x @ A_all^T, each token's row masked to
its adapter's columns, then h @ B_all^T added to the base projection. The scale (alpha / r) is
folded into B. The masks are persistent buffers the runner sets from the tokens' slots before each
step, so the CUDA graphs capture them like any other input.

Under tensor parallelism a column-parallel projection holds its rows of B (A whole); a
row-parallel one holds its input columns of A (B whole), and its delta, like the base output, is
this rank's part of a sum over the ranks.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from engine.config import ModelConfig
from kvcache.calc import LORA_TARGETS

# a PEFT target -> (our module under the decoder layer, its packed part)
TARGETS = dict(zip(LORA_TARGETS, (("self_attn.qkv_proj", 0), ("self_attn.qkv_proj", 1), ("self_attn.qkv_proj", 2),
                                  ("self_attn.o_proj", 0), ("mlp.gate_up_proj", 0), ("mlp.gate_up_proj", 1),
                                  ("mlp.down_proj", 0))))
PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    pass


@dataclass
class LoraAdapter:
    name: str
    rank: int  # the largest of its projections'
    # (layer, PEFT target) -> (A [r, in], scale * B [out, r]), float32, whole (not a rank's part)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _alpha(config: dict, module: str, rank: int) -> float:
    """The module's scale: lora_alpha (or alpha_pattern's entry for it) over r, or over sqrt(r)
    with rsLoRA."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            alpha = value
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def load_adapter(name: str, path: str | Path, cfg: ModelConfig) -> LoraAdapter:
    """A PEFT LoRA checkpoint for a model of cfg's shapes; LoraError says what does not fit."""
    folder = Path(path).expanduser()
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_config.json in {folder}")
    if not weights_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {folder} "
                        "(save it with safe_serialization=True)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(f"LoRA adapter {name!r}: {config_file} is not JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    unsupported = [k for k in ("use_dora", "modules_to_save") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    if unsupported:
        raise LoraError(f"LoRA adapter {name!r}: {', '.join(unsupported)} is not supported; "
                        "serve a plain LoRA adapter (or merge this one into the weights)")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None or m.group(3) not in TARGETS:
                raise LoraError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a projection in "
                                f"a decoder layer ({', '.join(TARGETS)})")
            layer = int(m.group(1))
            if layer >= cfg.num_layers:
                raise LoraError(f"LoRA adapter {name!r}: {key!r} names layer {layer}; the model has {cfg.num_layers}")
            pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = f.get_tensor(key).float()
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    qkv = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
           "v_proj": cfg.num_kv_heads * cfg.head_dim}
    shapes = {**qkv, "o_proj": cfg.hidden_size, "gate_proj": cfg.intermediate_size,
              "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}
    inputs = {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}
    weights = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer}'s {target} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        want_a, want_b = (r, inputs.get(target, cfg.hidden_size)), (shapes[target], r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer}'s {target} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; this model wants {want_a} and {want_b} (an adapter of another model?)")
        module = f"model.layers.{layer}.{'self_attn' if target in qkv or target == 'o_proj' else 'mlp'}.{target}"
        weights[(layer, target)] = (a, b * _alpha(config, module, r))
    return LoraAdapter(name, max(a.shape[0] for a, _ in weights.values()), weights)


@dataclass
class LoraWeights:
    """One projection's adapters, stacked: column c of h belongs to adapter slot c // (parts * rank)."""
    a: torch.Tensor  # [slots * parts * rank, in] (this rank's input columns of a row-parallel projection)
    b: torch.Tensor  # [out, slots * parts * rank] (this rank's rows of a column-parallel one)
    mask: torch.Tensor  # the step's [max tokens, slots * parts * rank]: 1 where the column is the token's adapter's

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += each token's adapter's x A^T B^T (nothing for a token without one)."""
        t = x.shape[0]
        assert t <= self.mask.shape[0], f"{t} tokens; the adapter masks hold {self.mask.shape[0]}"
        h = F.linear(x, self.a)
        h.mul_(self.mask[:t])
        y.addmm_(h, self.b.t())


@dataclass
class LoraModule:
    """A projection that holds adapters: its place (layer, path in the layer) and weights."""
    module: nn.Module
    layer: int  # the model's layer index (not the pipeline stage's)
    path: str  # in the decoder layer (PARTS)
    weights: LoraWeights


class LoraMasks:
    """The adapters' slots on this rank: which stacked columns each of a step's tokens uses, one
    mask per packing (1, 2 or 3 parts), shared by every layer's projections: set before each step,
    outside the CUDA graphs, which read them like any other input (a padded row's mask is never read
    back). Also the projections that hold adapters: write() fills a slot in place (the graphs keep
    their addresses), detached() gives the model without them (graphs of steps that use none)."""

    def __init__(self, slots: int, rank: int, max_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.slots, self.rank = slots, rank
        self.masks = {p: torch.zeros(max_tokens, slots * p * rank, dtype=dtype, device=device) for p in (1, 2, 3)}
        self.columns = {p: torch.arange(slots * p * rank, device=device) // (p * rank) for p in (1, 2, 3)}
        self.set_rows = 0  # rows before this may be non-zero
        self.modules: list[LoraModule] = []
        self.layers: range = range(0)  # the model's layers on this rank (a pipeline stage's)

    @contextmanager
    def detached(self) -> Iterator[None]:
        """The model's projections without their adapters inside the block."""
        for m in self.modules:
            m.module.lora = None
        try:
            yield
        finally:
            for m in self.modules:
                m.module.lora = m.weights

    def set(self, token_slots: torch.Tensor | None) -> None:
        """The masks of a step whose tokens use these adapter slots (-1: none); None: no token uses one."""
        if token_slots is None:
            if self.set_rows:
                for m in self.masks.values():
                    m[:self.set_rows].zero_()
                self.set_rows = 0
            return
        n = token_slots.shape[0]
        for p, m in self.masks.items():
            m[:n].copy_(token_slots[:, None] == self.columns[p])
        self.set_rows = max(self.set_rows, n)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """This rank's part of adapter into slot (what was there before is gone). LoraError where
        it does not fit the slots: a larger rank, or a projection the slots were not made for."""
        if adapter.rank > self.rank:
            raise LoraError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}; the adapter slots hold up to "
                            f"{self.rank} (max_lora_rank)")
        held = {(m.layer, t) for m in self.modules for t, (p, _) in TARGETS.items() if p == m.path}
        missing = sorted({t for layer, t in adapter.weights if layer in self.layers and (layer, t) not in held})
        if missing:
            raise LoraError(f"LoRA adapter {adapter.name!r} adapts {', '.join(missing)}, which the adapter slots "
                            "were not made for; load it at start-up or enable LoRA for every projection")
        for m in self.modules:
            self._write_module(m, slot, adapter)

    def _write_module(self, m: LoraModule, slot: int, adapter: LoraAdapter) -> None:
        parts, rank = PARTS[m.path], self.rank
        a_all, b_all, shard = m.weights.a, m.weights.b, m.module.shard
        first = slot * parts * rank
        a_all[first:first + parts * rank].zero_()
        b_all[:, first:first + parts * rank].zero_()
        for t, (path, part) in TARGETS.items():
            ab = adapter.weights.get((m.layer, t)) if path == m.path else None
            if ab is None:
                continue
            a, b = ab
            col, r = first + part * rank, a.shape[0]
            if shard.dim == 0:  # column parallel: this rank's rows of each part's B
                seg, at = shard.segments[part], shard.local_offset(part)
                a_all[col:col + r].copy_(a)
                b_all[at:at + seg.length, col:col + r].copy_(b[seg.start:seg.start + seg.length])
            else:  # row parallel: this rank's input columns of A
                seg = shard.segments[0]
                a_all[col:col + r].copy_(a[:, seg.start:seg.start + seg.length])
                b_all[:, col:col + r].copy_(b)


def attach(model: nn.Module, slots: int, rank: int, targets: frozenset[str], max_tokens: int,
           device: torch.device, dtype: torch.dtype) -> LoraMasks:
    """Adapter slots on the model's projections that `targets` name: each gets a LoraWeights
    (module.lora; None on the others) of `slots` adapters of up to `rank`, all zeros until
    LoraMasks.write() fills a slot. -> the masks, which the runner sets before each step."""
    masks = LoraMasks(slots, rank, max_tokens, device, dtype)
    masks.layers = range(model.stage.start, model.stage.end)
    hidden = model.global_cfg.hidden_size
    for i, layer in enumerate(model.layers):
        for path, parts in PARTS.items():
            module = layer.get_submodule(path)
            module.lora = None
            if not any(TARGETS[t][0] == path for t in targets):
                continue
            width = slots * parts * rank
            shard = module.shard
            a_in = hidden if shard.dim == 0 else shard.local_size
            b_out = shard.local_size if shard.dim == 0 else hidden
            module.lora = LoraWeights(torch.zeros(width, a_in, device=device, dtype=dtype),
                                      torch.zeros(b_out, width, device=device, dtype=dtype), masks.masks[parts])
            masks.modules.append(LoraModule(module, model.stage.start + i, path, module.lora))
    return masks
