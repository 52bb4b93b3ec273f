"""LoRA adapters as requests name them: vLLM's LoRARequest offline, the `model` field over HTTP
(the engine core keeps them: scheduler/lora.py); and their sizing from their configs (kv-calc)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.calc import LORA_TARGETS, LoraShape


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter is found by its name among those the engine has loaded (lora_modules at
    start-up, or earlier requests); with enable_lora, lora_path loads one that is not. lora_int_id
    is accepted for compatibility (the engine numbers the adapters itself)."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def lora_numbers(core: Any, requests: list[LoRARequest | str | None]) -> list[int]:
    """Each request's SamplingParams.lora on the engine core (0: the base model), loading into the
    engine the adapters that are not loaded (LLM(enable_lora=True)); ValueError says why one can't be."""
    wanted = frozenset(r if isinstance(r, str) else r.lora_name for r in requests if r is not None)
    registry = core.loras
    if registry.runtime and len(wanted) > registry.slots:
        raise ValueError(f"these prompts ask for {len(wanted)} LoRA adapters; the engine holds {registry.slots} at "
                         "once (max_loras)")
    return [0 if r is None else core.load_lora(*((r, "") if isinstance(r, str) else (r.lora_name, r.lora_path)),
                                               pinned=wanted)
            for r in requests]


def lora_shape(folders: list[str]) -> LoraShape:
    """kvcache/calc.py's LoraShape of these PEFT adapters, from their adapter_config.json alone
    (the largest rank, rank_pattern's included; the projections their target_modules name), for
    sizing without loading them; ValueError says what is wrong."""
    rank, targets = 0, set()
    for folder in folders:
        path = Path(folder).expanduser() / "adapter_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter {folder}: can't read {path} ({e})") from None
        rank = max([rank, int(config.get("r", 8))] + [int(r) for r in (config.get("rank_pattern") or {}).values()])
        wanted = config.get("target_modules") or []
        for t in LORA_TARGETS:
            module = f"model.layers.0.{'mlp' if t in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{t}"
            if (wanted == "all-linear" or (isinstance(wanted, str) and re.fullmatch(wanted, module))
                    or (isinstance(wanted, list) and any(module == w or module.endswith("." + w) for w in wanted))):
                targets.add(t)
    return LoraShape(len(folders), rank, frozenset(targets))
