"""Greedy output with prefix caching equals output without it (float32, CPU)."""
import random

import pytest

from serve import LLM, SamplingParams
from tests.models import VOCAB

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(3, VOCAB) for _ in range(48)]
    other = [rng.randrange(3, VOCAB) for _ in range(20)]
    return [
        base + [5, 6, 7],           # shares 3 whole blocks with the next
        base + [8, 9],
        base[:40] + [11] * 9,       # shares 2 whole blocks and part of a third
        base[:32],                  # exactly two full blocks, all cached
        base + [5, 6, 7],           # the exact full prompt again
        other,                      # shares nothing
    ]


def run(path, caching, **kw):
    llm = LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=caching, **kw)
    outs = []
    for p in prompts():  # one at a time, so later prompts find the earlier ones cached
        outs.append(llm.generate([p], GREEDY)[0].token_ids)
    outs += [o.token_ids for o in llm.generate(prompts(), GREEDY)]  # and all at once
    return outs, llm


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_caching_equals_no_caching(tiny_models, arch):
    want, _ = run(tiny_models[arch], False, num_kv_blocks=64)
    got, llm = run(tiny_models[arch], True, num_kv_blocks=64)
    assert got == want
    sched = llm.engine.core.scheduler
    assert sched.prefix_cache_hits > 0
    sched.check_integrity()


def test_prefix_caching_under_eviction_and_preemption(tiny_models):
    want, _ = run(tiny_models["llama"], False, num_kv_blocks=64)
    # 8 blocks of 16: every prompt needs up to 4, so cached blocks get evicted and the batch preempts.
    got, llm = run(tiny_models["llama"], True, num_kv_blocks=8)
    assert got == want
    core = llm.engine.core
    assert core.stats.num_preemptions > 0 and core.block_manager.num_evictions > 0
    assert core.block_manager.num_free_blocks == 8
    core.scheduler.check_integrity()
