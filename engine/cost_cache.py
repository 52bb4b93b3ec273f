"""The start-up cost model's measurements, kept on disk between starts.

The cost-model phase (the forward timed at every step bucket, an early compile pass beside it)
took 8.7 s of a 16.8 s warm engine start of Llama-3-8B on an H100 (bench/NOTES.md, 2026-11-26), and
the curve comes out the same each time on the same GPU, code and configuration. The key names all of those: the GPU, the torch/Triton/CUDA versions, a digest of the
engine's and kernels' sources, the model's shapes and the engine configuration; anything else
measures afresh. The files go where the default model's conversion goes ($PAGEDSERVE_CACHE, else
~/.cache/pagedserve). A file that can't be read or written is a miss, never an error.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.default_model import cache_dir

log = logging.getLogger("pagedserve")

VERSION = 1  # bump when the stored fields change meaning
_SOURCES = ("engine", "kernels", "kvcache")  # packages whose code shapes a forward's time


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the .py files of the packages a forward runs (names and contents, sorted)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _SOURCES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cost_key(parts: dict[str, Any]) -> str:
    """A file name for these measurement conditions (parts: JSON-able)."""
    text = json.dumps({"version": VERSION, "source": source_digest(), **parts}, sort_keys=True, default=str)
    return "step-costs-" + hashlib.sha256(text.encode()).hexdigest()[:32] + ".json"


def load(key: str) -> dict[str, Any] | None:
    path = cache_dir() / key
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    return data


def store(key: str, data: dict[str, Any]) -> None:
    path = cache_dir() / key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": VERSION, **data}))
        os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new, never half
    except OSError as e:
        log.debug("step cost model not cached (%s)", e)
