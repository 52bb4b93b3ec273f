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
