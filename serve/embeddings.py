"""Embeddings from the served model (POST /v1/embeddings, LLM.embed): each input's final hidden
states pooled by the engine (engine/pooling.py), then cut to `dimensions` and normalized here.

How a model pools is read from its sentence-transformers files, as vLLM does: modules.json names a
Pooling module (its config.json: last token, mean or CLS) and whether a Normalize module follows.
Without them a decoder model pools its last token and normalizes (Qwen3-Embedding, e5-mistral,
gte-Qwen2's last-token form). A Dense module after the pooling, which no decoder embedding model of
these families has, is refused: its projection is not served.
"""
from __future__ import annotations

import base64
import json
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


class PoolingConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Pooling:
    how: str = "last"  # SamplingParams.pooling
    normalize: bool = True


def model_pooling(folder: Path | None) -> Pooling:
    """The model folder's pooling (Pooling() where it has no sentence-transformers modules.json)."""
    if folder is None:
        return Pooling()
    folder = folder.parent if folder.is_file() else folder
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        pooling = next((m for m in modules if m["type"].endswith("Pooling")), None)
        spec = json.loads((folder / pooling["path"] / "config.json").read_text()) if pooling is not None else {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PoolingConfigError(f"{modules_file}: cannot read the sentence-transformers modules ({e})") from None
    if "Dense" in kinds:
        raise PoolingConfigError(f"{modules_file}: a Dense module follows the pooling; it is not served")
    modes = [how for key, how in MODES.items() if spec.get(key)]
    others = [k for k, v in spec.items() if k.startswith("pooling_mode_") and v and k not in MODES]
    if others or len(modes) > 1:
        raise PoolingConfigError(f"{modules_file}: pooling {', '.join(others + modes)} is not served (one of last "
                                 "token, mean or CLS)")
    return Pooling(modes[0] if modes else "last", "Normalize" in kinds)


def finish_vector(pooled: array, dimensions: int | None, normalize: bool) -> np.ndarray:
    """A pooled hidden state cut to its first `dimensions` (Matryoshka) and scaled to unit length."""
    v = np.frombuffer(pooled, dtype=np.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.astype(np.float32, copy=False)


def encode_vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a list of numbers; base64: the little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()
