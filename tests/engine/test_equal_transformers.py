"""Greedy output of the engine equals transformers' generate, token for token (float32, CPU)."""
import random

import pytest

from serve import LLM, SamplingParams
from tests.models import VOCAB, hf_greedy

MAX_NEW = 20


def make_prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 7, 16, 17, 33, 50][:n]  # odd lengths, exact and partial blocks
    return [[rng.randrange(3, VOCAB) for _ in range(L)] for L in lengths]


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = make_prompts(1)
    return prompts, {arch: hf_greedy(path, prompts, MAX_NEW) for arch, path in tiny_models.items()}


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("setting", ["roomy", "preempt", "chunked"])
def test_greedy_equals_transformers(tiny_models, expected, arch, setting):
    prompts, want = expected
    kwargs = dict(dtype="float32", device="cpu")
    if setting == "roomy":
        kwargs.update(num_kv_blocks=256)
    elif setting == "preempt":
        # 6 sequences of up to 70 tokens need up to 5 blocks of 16 each: 10 blocks forces preemption.
        kwargs.update(num_kv_blocks=10)
    else:
        kwargs.update(num_kv_blocks=256, max_num_batched_tokens=8, max_num_seqs=3)
    check_greedy(LLM(str(tiny_models[arch]), **kwargs), prompts, want[arch], setting, GREEDY)


def check_greedy(llm: LLM, prompts: list[list[int]], want: list[list[int]], setting: str,
                 params: SamplingParams) -> None:
    """llm's greedy outputs equal want, and the setting did what it is for: "preempt" preempted,
    "chunked" took more steps than one per prompt and token; no KV block is left held."""
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    core = llm.engine.core
    if setting == "preempt":
        assert core.stats.num_preemptions > 0
    if setting == "chunked":
        assert core.stats.num_steps > len(prompts) * params.max_tokens / 3
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    core.scheduler.check_integrity()


def test_text_prompts_and_order(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=64)
    texts = ["Hello, world!", "The quick brown fox", "Paris is"]
    outs = llm.generate(texts, GREEDY)
    want = hf_greedy(tiny_models["llama"], [llm.tokenizer.encode(t) for t in texts], MAX_NEW)
    assert [o.token_ids for o in outs] == want
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
