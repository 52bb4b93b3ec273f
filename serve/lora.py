"""LoRA adapters as requests name them: vLLM's LoRARequest offline, the `model` field over HTTP.
An adapter's number (SamplingParams.lora) is its place in the engine's lora_modules, from 1."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter is found by its name among those the engine loaded at start-up
    (lora_modules); lora_int_id and lora_path are accepted for compatibility and checked against it."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def adapter_names(config: Any) -> list[str]:
    """The names of an engine config's adapters, in order (none without a config)."""
    return [name for name, _ in getattr(config, "lora_modules", ())]


def lora_number(config: Any, request: LoRARequest | str | None) -> int:
    """request's adapter as SamplingParams.lora (0: none); ValueError where the engine lacks it."""
    if request is None:
        return 0
    name = request if isinstance(request, str) else request.lora_name
    names = adapter_names(config)
    if name not in names:
        loaded = ", ".join(repr(n) for n in names) or "none"
        raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded}); adapters load at start-up: "
                         "LLM(lora_modules={name: folder}) or serve run --lora-modules name=folder")
    if isinstance(request, LoRARequest) and request.lora_path:
        path = dict(config.lora_modules)[name]
        from pathlib import Path

        if Path(request.lora_path).expanduser().resolve() != Path(path).expanduser().resolve():
            raise ValueError(f"LoRA adapter {name!r} was loaded from {path}, not {request.lora_path}")
    return names.index(name) + 1


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_shape(folders: list[str]) -> Any:
    """kvcache/calc.py's LoraShape of these PEFT adapters, from their adapter_config.json alone
    (the largest rank, rank_pattern's included; the projections their target_modules name), for
    sizing without loading them; ValueError says what is wrong."""
    import json
    import re
    from pathlib import Path

    from kvcache.calc import LoraShape

    rank, targets = 0, set()
    for folder in folders:
        path = Path(folder).expanduser() / "adapter_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter {folder}: can't read {path} ({e})") from None
        rank = max([rank, int(config.get("r", 8))] + [int(r) for r in (config.get("rank_pattern") or {}).values()])
        wanted = config.get("target_modules") or []
        for t in TARGETS:
            module = f"model.layers.0.{'mlp' if t in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{t}"
            if (wanted == "all-linear" or (isinstance(wanted, str) and re.fullmatch(wanted, module))
                    or (isinstance(wanted, list) and any(module == w or module.endswith("." + w) for w in wanted))):
                targets.add(t)
    return LoraShape(len(folders), rank, frozenset(targets))
