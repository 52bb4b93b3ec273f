"""Rope scaling beyond Llama 3.1's: YaRN (how Qwen2.5 and Qwen3 serve 128k contexts) and linear.
The cos/sin table equals transformers' rotary embedding (YaRN's attention factor included), greedy
output equals transformers' past the original context, and the context served is the original
length times the factor, as vLLM reads these configs."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import ModelConfig
from engine.models.llama import rope_cos_sin
from serve import LLM, SamplingParams
from tests.models import VOCAB, build_model, hf_greedy

SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 0.707 * 0.9, "beta_fast": 16, "beta_slow": 2},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled(request, tmp_path_factory):
    kind = request.param
    path = build_model("qwen2", tmp_path_factory.mktemp(kind) / "qwen2", rope_scaling=SCALINGS[kind],
                       max_position_embeddings=256 if kind == "linear" else 512)
    return kind, path


def test_the_table_is_transformers(scaled):
    import transformers

    kind, path = scaled
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    positions = torch.arange(600)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    ours = rope_cos_sin(ModelConfig.from_path(path), 600, "cpu")
    torch.testing.assert_close(ours[:, 0], cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[:, 1], sin[0], rtol=1e-5, atol=1e-5)


def test_greedy_past_the_original_context(scaled):
    kind, path = scaled
    cfg = ModelConfig.from_path(path)
    assert cfg.max_context_len == {"yarn": 512, "yarn-mscale": 512, "linear": 512}[kind]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 90, 200)]
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128)
    assert llm.engine.max_model_len == 512
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    assert got == hf_greedy(path, prompts, 12)


def test_triton_rotary_kernels_read_the_scaled_table(scaled):
    """The Triton op set (interpreted on the CPU) rotates with the same table, YaRN's factor included."""
    pytest.importorskip("triton")
    kind, path = scaled
    if kind == "linear":
        pytest.skip("the table differs from the default only by its frequencies: yarn covers it")
    prompts = [[5, 9, 33, 70, 101, 7] * 25]  # 150 tokens: past yarn's original 128 / 64
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, backend="triton", max_num_batched_tokens=64)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]
    assert got == hf_greedy(path, prompts, 4)
