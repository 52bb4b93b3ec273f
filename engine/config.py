"""ModelConfig: what the engine needs from a Hugging Face config.json, validated once."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ModelConfigError(ValueError):
    """A model folder or config.json the engine can't use; the message says why."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            got = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
            raise ModelConfigError(f"unsupported architecture {got}; pagedserve supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // num_heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 nests rope settings here
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get("rope_theta")
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            model_type = cfg.get("model_type", "")
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2" or arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                torch_dtype=dtype if dtype in DTYPE_BYTES else "bfloat16",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                raw=cfg,
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks the field {e.args[0]!r}") from None

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        """From a model folder or a config.json file."""
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise ModelConfigError(f"no config.json in {path}: pass a Hugging Face model folder")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_file} is not valid JSON: {e}") from None
        return cls.from_dict(cfg)

    @property
    def max_context_len(self) -> int:
        """The longest context the engine serves: max_position_embeddings, or the sliding window
        where one applies (there is no sliding-window attention here, so stay inside it)."""
        window = self.raw.get("sliding_window")
        if window and self.raw.get("use_sliding_window", self.architecture == "MistralForCausalLM"):
            return min(self.max_position_embeddings, int(window))
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count from the shapes (embedding and lm_head counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params() * DTYPE_BYTES[dtype]

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 per weight of the matmuls (the embedding lookup is free,
        the lm_head is not) plus attention's QK^T and PV over context_len positions."""
        matmul_params = self.num_params() - self.vocab_size * self.hidden_size * (0 if self.tie_word_embeddings else 1)
        attn = 4 * self.num_layers * self.q_size * context_len
        return 2.0 * matmul_params + attn
