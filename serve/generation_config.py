"""A model's own sampling defaults: the fields of its generation_config.json that a request leaves
out take the model's values, as vLLM does by default (`--generation-config auto`; Qwen2.5-Instruct
ships temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). `vllm` keeps pagedserve's own
defaults (temperature 1, no filters); a folder reads its generation_config.json instead. As in
vLLM, `do_sample` is not read: a request that wants greedy output asks for temperature 0."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scheduler.request import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_folder(cfg: Any) -> Path | None:
    """The engine config's model folder (or config.json) where it names one that exists; None for
    the default model (converted from GGUF, without a generation config) and for presets."""
    model = getattr(cfg, "model", None)
    if model is None:
        return None
    path = Path(model).expanduser()
    return path if path.exists() else None


def sampling_defaults(setting: str, model_dir: Path | None) -> dict[str, Any]:
    """-> {field: value} for the fields of SAMPLING_FIELDS the generation config sets; {} for
    `vllm` or a model folder without one. A bad file or value is a ValueError that names it."""
    if setting == "vllm":
        return {}
    folder = model_dir if setting == "auto" else Path(setting)
    if folder is None:
        return {}
    path = (folder.parent if folder.is_file() else folder) / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    out: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number; got {value!r}")
        out[name] = int(value) if name == "top_k" else float(value)
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out
