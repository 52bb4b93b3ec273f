"""Model presets (engine/presets.py) and GPU memory presets and sizes (kvcache/gpus.py)."""
from __future__ import annotations

import json

import pytest

from engine.config import ModelConfig
from engine.presets import MODEL_PRESETS, find_model_preset, resolve_model
from kvcache.gpus import GPU_PRESETS, GiB, PresetError, parse_size, preset_key, resolve_gpu_memory


def preset(name: str) -> ModelConfig:
    return resolve_model(name).config


def test_every_model_preset_name_and_alias_resolves_case_insensitively():
    for p in MODEL_PRESETS:
        for name in (p.name, p.name.upper(), p.name.lower(), *p.aliases):
            assert resolve_model(name).name == p.name


def test_common_spellings_resolve():
    assert find_model_preset("llama3-8b").name == "Llama-3-8B"
    assert find_model_preset("LLAMA_3_70B").name == "Llama-3-70B"
    assert find_model_preset("qwen2.5-0.5b").name == "Qwen2.5-0.5B"
    assert find_model_preset("mistral-7b").name == "Mistral-7B"
    assert find_model_preset("gpt-2") is None


def test_preset_names_do_not_collide():
    for presets in (MODEL_PRESETS, GPU_PRESETS):
        keys = [(preset_key(n), p.name) for p in presets for n in {p.name, *p.aliases}]
        owners: dict[str, set[str]] = {}
        for key, owner in keys:
            owners.setdefault(key, set()).add(owner)
        assert all(len(o) == 1 for o in owners.values()), owners


def test_model_from_folder_and_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS[2].config_dict()))
    from_folder = resolve_model(str(tmp_path))
    from_file = resolve_model(str(tmp_path / "config.json"))
    assert from_folder.config == from_file.config == preset("Qwen2.5-0.5B")
    assert from_folder.name == tmp_path.name


def test_unknown_model_lists_the_presets():
    with pytest.raises(PresetError, match="Llama-3-8B"):
        resolve_model("no-such-model")


@pytest.mark.parametrize("text, size", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("80 gib", 80 * 2**30), ("80G", 80 * 2**30),
    ("1.5TiB", int(1.5 * 2**40)), ("512MiB", 512 * 2**20), ("24gb", 24 * 10**9), ("1073741824B", 2**30),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80", "abc", "0GB", "-1GB", "80XB", "", "GB"])
def test_parse_size_rejects(text):
    with pytest.raises(PresetError):
        parse_size(text)


@pytest.mark.parametrize("name, canonical", [
    ("H100", "H100-80GB"), ("h100-80gb", "H100-80GB"), ("H100 80GB", "H100-80GB"), ("A100-40GB", "A100-40GB"),
    ("a100-80gb", "A100-80GB"), ("L4", "L4"), ("RTX4090", "RTX4090"), ("rtx-4090", "RTX4090"), ("H200", "H200"),
])
def test_gpu_presets(name, canonical):
    assert resolve_gpu_memory(name).label == canonical


def test_gpu_preset_sizes():
    assert resolve_gpu_memory("H100").total_bytes == 85_017_493_504  # what CUDA reports on an H100 80GB HBM3
    assert resolve_gpu_memory("A100-40GB").total_bytes == 40960 * 2**20
    assert resolve_gpu_memory("80GiB").total_bytes == 80 * GiB


def test_unknown_gpu_lists_the_presets():
    with pytest.raises(PresetError, match="H100-80GB"):
        resolve_gpu_memory("TPUv5")
