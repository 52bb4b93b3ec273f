"""Named model shapes and GPU memory sizes for `serve kv-calc`, and the parsing of --model and
--gpu-memory into a ModelConfig and a byte count.

Model presets hold the public config.json values of each model (the fields ModelConfig reads)
and go through ModelConfig.from_dict like any folder would.

GPU presets hold the total memory CUDA reports (torch.cuda.mem_get_info()[1]): the number the
engine multiplies by the memory utilization. It is nvidia-smi's memory.total less the driver's
reserved memory (H100 80GB HBM3: 81559 - 480 MiB; H200: 143771 - 616 MiB, both measured with
driver 580). Where we have not measured a card, the preset holds nvidia-smi's memory.total, which
overstates CUDA's figure by a few hundred MiB (under 1% of the cache); pass a size to be exact.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig, ModelConfigError

MiB = 1 << 20
GiB = 1 << 30


class PresetError(ValueError):
    """An unknown preset name or a malformed size; the message lists what is accepted."""


@dataclass(frozen=True)
class ModelPreset:
    name: str
    source: str  # the Hugging Face repository whose config.json these values are
    aliases: tuple[str, ...]
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int

    def config_dict(self) -> dict[str, Any]:
        """A fresh Hugging Face style config.json dict."""
        return {
            "architectures": [self.architecture],
            "model_type": self.architecture.removesuffix("ForCausalLM").lower(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
        }

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config_dict())


@dataclass(frozen=True)
class GPUPreset:
    name: str
    memory_bytes: int
    aliases: tuple[str, ...] = ()
    measured: bool = False  # True: CUDA's total as measured; False: nvidia-smi's memory.total


MODEL_PRESETS: tuple[ModelPreset, ...] = (
    ModelPreset("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", ("llama3-8b", "llama-3.1-8b", "llama3.1-8b"),
                "LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 500000.0, 1e-5, False, 128000, 128001),
    ModelPreset("Llama-3-70B", "meta-llama/Meta-Llama-3-70B", ("llama3-70b", "llama-3.1-70b", "llama3.1-70b"),
                "LlamaForCausalLM", 128256, 8192, 28672, 80, 64, 8, 128, 8192, 500000.0, 1e-5, False, 128000, 128001),
    ModelPreset("Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", ("qwen2.5-0.5b-instruct", "qwen25-0.5b"),
                "Qwen2ForCausalLM", 151936, 896, 4864, 24, 14, 2, 64, 32768, 1000000.0, 1e-6, True, 151643, 151643),
    ModelPreset("Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct", ("qwen2.5-7b-instruct", "qwen25-7b"),
                "Qwen2ForCausalLM", 152064, 3584, 18944, 28, 28, 4, 128, 32768, 1000000.0, 1e-6, False, 151643, 151645),
    ModelPreset("Mistral-7B", "mistralai/Mistral-7B-v0.3", ("mistral-7b-v0.3", "mistral-7b-instruct-v0.3"),
                "MistralForCausalLM", 32768, 4096, 14336, 32, 32, 8, 128, 32768, 1000000.0, 1e-5, False, 1, 2),
    ModelPreset("Qwen3-8B", "Qwen/Qwen3-8B", ("qwen3-8b-base",),
                "Qwen3ForCausalLM", 151936, 4096, 12288, 36, 32, 8, 128, 40960, 1000000.0, 1e-6, False, 151643, 151645),
)

GPU_PRESETS: tuple[GPUPreset, ...] = (
    GPUPreset("H100-80GB", 85_017_493_504, ("h100", "h100-sxm", "h100-80gb-hbm3"), measured=True),
    GPUPreset("H100-PCIe", 81559 * MiB, ("h100-pcie-80gb",)),
    GPUPreset("H100-NVL", 95830 * MiB, ("h100-94gb",)),
    GPUPreset("H200", 150_109_880_320, ("h200-141gb", "h200-sxm"), measured=True),
    GPUPreset("B200", 183359 * MiB, ("b200-180gb",)),
    GPUPreset("A100-80GB", 81920 * MiB, ("a100",)),
    GPUPreset("A100-40GB", 40960 * MiB),
    GPUPreset("L40S", 46068 * MiB),
    GPUPreset("L40", 46068 * MiB),
    GPUPreset("A6000", 49140 * MiB, ("rtx-a6000",)),
    GPUPreset("L4", 23034 * MiB),
    GPUPreset("A10", 23028 * MiB, ("a10g",)),
    GPUPreset("RTX4090", 24564 * MiB, ("4090", "geforce-rtx-4090")),
    GPUPreset("RTX3090", 24576 * MiB, ("3090", "geforce-rtx-3090")),
    GPUPreset("T4", 15360 * MiB),
    GPUPreset("V100-32GB", 32768 * MiB, ("v100",)),
    GPUPreset("V100-16GB", 16384 * MiB),
)


def _key(name: str) -> str:
    """Case, spaces, dashes, dots and underscores don't matter: 'Llama-3-8B' == 'llama3_8b'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_model_preset(name: str) -> ModelPreset | None:
    key = _key(name)
    for preset in MODEL_PRESETS:
        if key in {_key(n) for n in (preset.name, *preset.aliases)}:
            return preset
    return None


def find_gpu_preset(name: str) -> GPUPreset | None:
    key = _key(name)
    for preset in GPU_PRESETS:
        if key in {_key(n) for n in (preset.name, *preset.aliases)}:
            return preset
    return None


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # the preset's name, or the folder/file as given
    config: ModelConfig


def resolve_model(spec: str) -> ResolvedModel:
    """--model: a model folder, a config.json path, or a preset name (a path wins over a name)."""
    path = Path(spec).expanduser()
    if path.exists():
        try:
            config = ModelConfig.from_path(path)
        except ModelConfigError as e:
            raise PresetError(str(e)) from None
        label = path.resolve().parent.name if path.is_file() else path.resolve().name
        return ResolvedModel(label or spec, config)
    preset = find_model_preset(spec)
    if preset is None:
        names = ", ".join(p.name for p in MODEL_PRESETS)
        raise PresetError(f"--model {spec!r} is neither a model folder, a config.json, nor a preset ({names})")
    return ResolvedModel(preset.name, preset.model_config())


def preset_folder(name: str, root: Path) -> Path | None:
    """A folder holding the named preset's config.json (written under root on first use), for
    serving the shape with dummy weights; None when no preset has that name."""
    preset = find_model_preset(name)
    if preset is None:
        return None
    folder = root / preset.name
    config = folder / "config.json"
    text = json.dumps(preset.config_dict(), indent=1)
    if not config.is_file() or config.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        config.write_text(text)
    return folder


_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    # bare letters are binary, as in PyTorch and Docker: 80G is 80 GiB
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}


@dataclass(frozen=True)
class GPUMemory:
    label: str  # the preset name, or the size as given
    total_bytes: int


def parse_size(text: str) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80000000000, '1.5 TiB', '512MiB', '1073741824B'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None:
        raise PresetError(f"can't read the size {text!r}: write a number and a unit, e.g. 80GiB or 80GB")
    unit = m.group(2).lower()
    if not unit:
        raise PresetError(f"the size {text!r} has no unit: write e.g. {text.strip()}GiB, {text.strip()}GB or {text.strip()}B")
    if unit not in _UNITS:
        raise PresetError(f"unknown unit {m.group(2)!r} in {text!r}: use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise PresetError(f"the size {text!r} must be more than zero")
    return size


def resolve_gpu_memory(spec: str) -> GPUMemory:
    """--gpu-memory: a GPU name (H100, A100-40GB, L4, ...) or a size with a unit (80GiB, 24GB)."""
    preset = find_gpu_preset(spec)
    if preset is not None:
        return GPUMemory(preset.name, preset.memory_bytes)
    if not re.match(r"\s*[\d.]", spec):
        names = ", ".join(p.name for p in GPU_PRESETS)
        raise PresetError(f"unknown GPU {spec!r}: give a size such as 80GiB, or one of {names}")
    return GPUMemory(spec.strip(), parse_size(spec))
