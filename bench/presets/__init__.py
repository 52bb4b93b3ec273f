"""Model shapes for benchmarks: a folder, a config.json, or a preset name from engine/presets.py
(Llama-3-8B, Qwen2.5-0.5B, ...: the configurations the ARCHITECTURE.md figures use), to be served
with dummy weights."""
from __future__ import annotations

from pathlib import Path

from engine.default_model import cache_dir
from engine.presets import MODEL_PRESETS, preset_folder


def preset_names() -> list[str]:
    return [p.name for p in MODEL_PRESETS]


def resolve_model(name_or_dir: str) -> Path:
    """A model folder (holding config.json), or the folder of the preset of that name."""
    path = Path(name_or_dir)
    if (path / "config.json").is_file():
        return path
    if path.is_file() and path.name == "config.json":
        return path.parent
    folder = preset_folder(name_or_dir, cache_dir() / "presets")
    if folder is not None:
        return folder
    raise ValueError(f"--model {name_or_dir!r} is neither a folder with a config.json nor a preset "
                     f"({', '.join(preset_names())})")
