"""Model folders: errors a user can act on, dummy weights, sharded checkpoints."""
import json
import subprocess
import sys

import pytest

from engine.config import EngineConfig, ModelConfig, ModelConfigError
from serve import LLM, SamplingParams


def test_unsupported_architecture_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_path(tmp_path)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "\n" not in msg
    r = subprocess.run([sys.executable, "-m", "serve.cli", "generate", "--model", str(tmp_path), "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "supports" in r.stderr


def test_missing_folder_and_missing_weights(tmp_path, tiny_models):
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "config.json").write_text((tiny_models["llama"] / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), device="cpu")


def test_dummy_weights_from_config_only(tmp_path, tiny_models):
    (tmp_path / "config.json").write_text((tiny_models["qwen2"] / "config.json").read_text())
    llm = LLM(str(tmp_path / "config.json"), device="cpu", load_format="dummy", num_kv_blocks=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["text needs a tokenizer"])


def test_bad_token_ids_and_config_values(tiny_models):
    llm = LLM(str(tiny_models["llama"]), device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 10**6]])
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_models["llama"]), block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_models["llama"]), dtype="float64")
    for bad in (-1.0, float("nan"), True, "5"):
        with pytest.raises(ValueError, match="prefill_hold_ms"):
            EngineConfig(prefill_hold_ms=bad)


def test_sharded_checkpoint_loads(tiny_models):
    assert (tiny_models["mistral"] / "model.safetensors.index.json").is_file()
