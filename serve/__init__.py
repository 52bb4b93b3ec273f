"""pagedserve's user-facing layer: `from serve import LLM, SamplingParams`."""
from __future__ import annotations

from typing import Any

from scheduler.request import SamplingParams
from serve.lora import LoRARequest

__all__ = ["LLM", "SamplingParams", "EngineConfig", "LoRARequest"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that the CLI's --help and the server's process stay free of torch.
    if name == "LLM":
        from serve.llm import LLM
        return LLM
    if name == "EngineConfig":
        from engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
