"""safetensors -> model parameters (single file or sharded with an index), or dummy weights."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.models.llama import LlamaForCausalLM


class WeightLoadError(ValueError):
    pass


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {folder} (use --load-format dummy for random weights)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(f"{folder}: the index names missing files {missing}")
    return files


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, folder: Path, show_progress: bool = True) -> None:
    params = dict(model.named_parameters())
    wmap = model.hf_weight_map()
    loaded: dict[str, int] = {}  # our name -> rows loaded (or -1 for whole)
    files = safetensors_files(folder)
    bar = tqdm(total=len(wmap), desc="loading weights", unit="tensor", disable=not show_progress, file=sys.stderr)
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in wmap:
                    if name == "lm_head.weight" and model.lm_head is None:
                        continue  # tied: some checkpoints still store the copy
                    if "rotary_emb" in name:
                        continue
                    raise WeightLoadError(f"{path.name}: unexpected tensor {name!r} for {model.cfg.architecture}")
                ours, off, rows = wmap[name]
                src = f.get_tensor(name)
                dst = params[ours] if rows < 0 else params[ours][off:off + rows]
                if tuple(src.shape) != tuple(dst.shape):
                    raise WeightLoadError(f"{name}: shape {tuple(src.shape)} does not match the config's {tuple(dst.shape)}")
                dst.copy_(src)
                loaded[name] = 1
                bar.update(1)
    bar.close()
    missing = [n for n in wmap if n not in loaded]
    if missing:
        raise WeightLoadError(f"{folder}: missing weights, e.g. {missing[:3]} ({len(missing)} in all)")


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights with the real shapes (benchmarks: throughput doesn't depend on values).
    Small uniform values keep activations finite in bf16; norms stay 1."""
    g = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.uniform_(-0.02, 0.02, generator=g)
