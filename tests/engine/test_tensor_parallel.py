"""LLM(tensor_parallel_size=2): two ranks with gloo on the CPU give transformers' greedy output in
float32 (roomy, and with chunked prefill and preemption; four ranks too), dummy weights give TP=1's model, a size
that does not split the model is a ValueError, and a rank killed mid-run fails every request
with the reason and stops the engine instead of hanging it."""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from scheduler.request import ExecutorLost
from serve import LLM, SamplingParams
from tests.engine.test_equal_transformers import make_prompts
from tests.models import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
CPU = dict(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def expected(tiny_models):
    prompts = make_prompts(2)
    return prompts, {arch: hf_greedy(tiny_models[arch], prompts, MAX_NEW) for arch in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("setting", ["roomy", "chunked-preempt"])
def test_tp2_greedy_equals_transformers(tiny_models, expected, arch, setting):
    prompts, want = expected
    # chunked-preempt: prompt chunks of up to 16 tokens; 8 blocks of 16 can't hold all six sequences
    kwargs = dict(num_kv_blocks=256) if setting == "roomy" else dict(num_kv_blocks=8, max_num_batched_tokens=16)
    with LLM(str(tiny_models[arch]), tensor_parallel_size=2, **CPU, **kwargs) as llm:
        assert llm.engine.runner.kv_spec.num_kv_heads == 1  # of 2 (split), or qwen2's 1 (on both ranks)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want[arch]
        core = llm.engine.core
        if setting == "chunked-preempt":
            assert core.stats.num_preemptions > 0
            assert core.stats.num_steps > len(prompts) * MAX_NEW / 4
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
        core.scheduler.check_integrity()
        # a second round on the same ranks: mirrored sequences of the first were dropped, new ones arrive
        again = llm.generate(prompts[:2], GREEDY)
        assert [o.token_ids for o in again] == want[arch][:2]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp4_greedy_equals_transformers(tiny_models, expected, arch):
    """Four ranks: llama's 2 KV heads and qwen2's 1 are each held by several ranks."""
    prompts, want = expected
    with LLM(str(tiny_models[arch]), tensor_parallel_size=4, num_kv_blocks=8, max_num_batched_tokens=16,
             **CPU) as llm:
        assert llm.engine.runner.kv_spec.num_kv_heads == 1
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want[arch]
        core = llm.engine.core
        assert core.stats.num_preemptions > 0
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_dummy_weights_tp2_equals_tp1(tmp_path, tiny_models):
    """One seeded random model whatever the rank count, with a vocabulary rank 1 pads (383 rows)."""
    cfg = json.loads((tiny_models["qwen2"] / "config.json").read_text())
    cfg["vocab_size"] = 383
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = [[5, 9, 300, 17], [380, 2, 77, 77, 41, 8, 8, 1, 99]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    kwargs = dict(load_format="dummy", num_kv_blocks=32, seed=7, **CPU)
    one = LLM(str(tmp_path / "config.json"), **kwargs).generate(prompts, params)
    with LLM(str(tmp_path / "config.json"), tensor_parallel_size=2, **kwargs) as llm:
        two = llm.generate(prompts, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-5)


def test_seeded_sampling_is_the_same_on_every_rank(tiny_models):
    """Random rows sample on every rank from the same logits and seeds: rank 1 follows rank 0's
    tokens (its pending inputs come from its own samples), so TP=2 equals TP=1."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    prompts = make_prompts(3, 3)
    one = LLM(str(tiny_models["llama"]), num_kv_blocks=64, **CPU).generate(prompts, params)
    with LLM(str(tiny_models["llama"]), num_kv_blocks=64, tensor_parallel_size=2, **CPU) as llm:
        two = llm.generate(prompts, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_penalties_are_the_same_on_every_rank(tiny_models):
    """Penalized rows count their tokens on every rank (engine/logit_adjust.py): rank 1's counts follow
    its own samples, which must be rank 0's, so TP=2 equals TP=1 (async scheduling, chunked prompts)."""
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, presence_penalty=1.0,
                             frequency_penalty=0.5, min_p=0.1, logit_bias={7: 2.0}),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, min_tokens=4, stop_token_ids=[3])] * 2
    prompts = make_prompts(5)
    kw = dict(num_kv_blocks=8, max_num_batched_tokens=16, async_scheduling=True, **CPU)
    one = LLM(str(tiny_models["llama"]), **kw).generate(prompts, params)
    with LLM(str(tiny_models["llama"]), tensor_parallel_size=2, **kw) as llm:
        two = llm.generate(prompts, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


@pytest.mark.parametrize("size, what", [(3, "attention heads"), (8, "attention heads")])
def test_a_size_that_does_not_split_the_model_is_a_value_error(tiny_models, size, what):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"tensor_parallel_size {size} must divide the model's 4 {what}; "
                                         "sizes that fit this model: 1, 2, 4"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=size, **CPU)
    assert time.monotonic() - t0 < 5  # refused before any rank starts
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=0, **CPU)


def kill_rank_mid_run(llm: LLM, before_kill: Callable[[Any], None] = lambda core: None) -> list:
    """Four greedy sequences stepped three times, then before_kill(core), then the engine's rank 1
    killed (SIGKILL) and one more step, which must come back within 10 s with every sequence
    finished with an error -> that step's outputs."""
    core = llm.engine.core
    worker = core.executor.workers.list[0].proc
    seqs = [core.add_request(p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
            for p in make_prompts(4, 3)]
    for _ in range(3):
        assert all(not o.error for o in core.step())
    before_kill(core)
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    t0 = time.monotonic()
    outs = core.step()
    assert time.monotonic() - t0 < 10
    assert sorted(o.seq_id for o in outs) == sorted(s.seq_id for s in seqs)
    assert all(o.finished and o.finish_reason == "error" for o in outs)
    return outs


def test_a_rank_killed_mid_run_fails_every_request_and_stops_the_engine(tiny_models):
    llm = LLM(str(tiny_models["llama"]), tensor_parallel_size=2, num_kv_blocks=64, **CPU)
    try:
        outs = kill_rank_mid_run(llm)
        assert all("tensor-parallel rank 1 exited (killed by signal SIGKILL)" in o.error for o in outs)
        core = llm.engine.core
        assert not core.has_unfinished() and core.lost is not None
        with pytest.raises(ExecutorLost, match="rank 1 exited"):
            core.add_request([1, 2, 3], GREEDY)
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.generate([[1, 2, 3]], GREEDY)
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < 10


def test_generate_raises_when_a_rank_dies_during_generate(tiny_models):
    """Through LLM.generate: the error reaches the caller, and the other ranks are stopped."""
    llm = LLM(str(tiny_models["qwen3"]), tensor_parallel_size=2, num_kv_blocks=64, **CPU)
    executor = llm.engine.core.executor
    os.kill(executor.workers.list[0].proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
        llm.generate(make_prompts(5, 2), GREEDY)
    assert all(not w.proc.is_alive() for w in executor.workers.list)


def same_prompt_logprobs(one: list, two: list) -> None:
    """Two runs' prompt logprobs, output by output: the same tokens and ranks, logprobs within float32 rounding."""
    for a, b in zip(one, two):
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (x is None) == (y is None)
            if x is not None:
                assert (y.token_id, [t for t, _ in y.top]) == (x.token_id, [t for t, _ in x.top])
                assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def test_prompt_logprobs_are_the_same_on_every_rank(tiny_models):
    """Every rank takes the prompt's rows through the vocabulary-parallel head in the same slices (an
    all-gather each), chunked prompts beside decodes: TP=2 equals TP=1."""
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=k) for k in (3, None, 0)]
    prompts = make_prompts(5)
    kw = dict(num_kv_blocks=16, max_num_batched_tokens=16, async_scheduling=True, **CPU)
    one = LLM(str(tiny_models["llama"]), **kw).generate(prompts, params * 2)
    with LLM(str(tiny_models["llama"]), tensor_parallel_size=2, **kw) as llm:
        two = llm.generate(prompts, params * 2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert sum(o.prompt_logprobs is not None for o in two) == 4
    same_prompt_logprobs(one, two)
