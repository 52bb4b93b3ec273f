"""LoRA adapters served beside the base model: PEFT checkpoints (adapter_config.json and
adapter_model.safetensors) loaded at start-up, any mix of them in one step.

Every adapter's A and B of a projection are stacked into one pair of matrices, a column group per
adapter (and per packed part: q|k|v, gate|up), so a step whose tokens each use an adapter of their
own, or none, costs two dense matmuls per projection: h = x @ A_all^T, each token's row masked to
its adapter's columns, then h @ B_all^T added to the base projection. The scale (alpha / r) is
folded into B. The mask comes from the model's per-token adapter slots, a persistent buffer the
runner writes before each step, so the CUDA graphs capture it like any other input.

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

# a PEFT target -> (our module under the decoder layer, its packed part)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}
PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    pass


@dataclass
class LoraAdapter:
    name: str
    path: Path
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
    return LoraAdapter(name, folder, max(a.shape[0] for a, _ in weights.values()), weights)


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


class LoraMasks:
    """Which stacked columns each of a step's tokens uses, one mask per packing (1, 2 or 3 parts),
    shared by every layer's projections: set before each step, outside the CUDA graphs, which
    read them like any other input (a padded row's mask is never read back). Also the projections
    that have adapters (detached(): the model without them, for graphs of steps that use none)."""

    def __init__(self, slots: int, rank: int, max_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.masks = {p: torch.zeros(max_tokens, slots * p * rank, dtype=dtype, device=device) for p in (1, 2, 3)}
        self.columns = {p: torch.arange(slots * p * rank, device=device) // (p * rank) for p in (1, 2, 3)}
        self.set_rows = 0  # rows before this may be non-zero
        self.modules: list[tuple[nn.Module, LoraWeights]] = []

    @contextmanager
    def detached(self) -> Iterator[None]:
        """The model's projections without their adapters inside the block."""
        for module, _ in self.modules:
            module.lora = None
        try:
            yield
        finally:
            for module, weights in self.modules:
                module.lora = weights

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


def attach(model: nn.Module, adapters: list[LoraAdapter], max_tokens: int, device: torch.device,
           dtype: torch.dtype) -> LoraMasks:
    """Give the model's projections that some adapter targets a LoraWeights (module.lora; None on
    the others) holding this rank's part of every adapter; adapter i is slot i. -> the masks, which
    the runner sets before each step."""
    rank = max(a.rank for a in adapters)
    masks = LoraMasks(len(adapters), rank, max_tokens, device, dtype)
    hidden = model.global_cfg.hidden_size
    first = model.stage.start
    for i, layer in enumerate(model.layers):
        for path, parts in PARTS.items():
            module = layer.get_submodule(path)
            module.lora = None
            targets = [t for t, (p, _) in TARGETS.items() if p == path]
            if not any((first + i, t) in a.weights for a in adapters for t in targets):
                continue
            width = len(adapters) * parts * rank
            shard = module.shard
            if shard.dim == 0:  # column parallel: this rank's rows of each part's B
                a_all = torch.zeros(width, hidden)
                b_all = torch.zeros(shard.local_size, width)
            else:  # row parallel: this rank's input columns of A
                a_all = torch.zeros(width, shard.local_size)
                b_all = torch.zeros(hidden, width)
            for slot, adapter in enumerate(adapters):
                for t in targets:
                    ab = adapter.weights.get((first + i, t))
                    if ab is None:
                        continue
                    a, b = ab
                    part = TARGETS[t][1]
                    col = (slot * parts + part) * rank
                    r = a.shape[0]
                    if shard.dim == 0:
                        seg, at = shard.segments[part], shard.local_offset(part)
                        a_all[col:col + r] = a
                        b_all[at:at + seg.length, col:col + r] = b[seg.start:seg.start + seg.length]
                    else:
                        seg = shard.segments[0]
                        a_all[col:col + r] = a[:, seg.start:seg.start + seg.length]
                        b_all[:, col:col + r] = b
            module.lora = LoraWeights(a_all.to(device, dtype), b_all.to(device, dtype), masks.masks[parts])
            masks.modules.append((module, module.lora))
    return masks
