"""Named model shapes (the public config.json values of each model, the fields ModelConfig reads),
and the parsing of --model into a ModelConfig: a folder, a config.json, or a preset name. Presets
go through ModelConfig.from_dict like any folder would, and serve with dummy weights."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig, ModelConfigError
from kvcache.gpus import PresetError, find_preset


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
    # mixtures of experts: (experts, experts per token, each expert's width); Mixtral's width is
    # its intermediate_size
    moe: tuple[int, int, int] | None = None

    def config_dict(self) -> dict[str, Any]:
        """A fresh Hugging Face style config.json dict."""
        model_type = {"Qwen3MoeForCausalLM": "qwen3_moe"}.get(self.architecture,
                                                              self.architecture.removesuffix("ForCausalLM").lower())
        d = {
            "architectures": [self.architecture],
            "model_type": model_type,
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
        if self.moe is not None:
            experts, top_k, width = self.moe
            d.update(num_experts=experts, num_local_experts=experts, num_experts_per_tok=top_k)
            if self.architecture == "Qwen3MoeForCausalLM":
                d.update(moe_intermediate_size=width, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return d

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config_dict())


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
    ModelPreset("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B", ("qwen3-30b-a3b-base", "qwen3-moe-30b"),
                "Qwen3MoeForCausalLM", 151936, 2048, 6144, 48, 32, 4, 128, 40960, 1000000.0, 1e-6, False, 151643, 151645,
                moe=(128, 8, 768)),
    ModelPreset("Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1", ("mixtral-8x7b-v0.1", "mixtral-8x7b-instruct-v0.1"),
                "MixtralForCausalLM", 32000, 4096, 14336, 32, 32, 8, 128, 32768, 1000000.0, 1e-5, False, 1, 2,
                moe=(8, 2, 14336)),
)

def find_model_preset(name: str) -> ModelPreset | None:
    return find_preset(MODEL_PRESETS, name)


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
