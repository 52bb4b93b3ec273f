"""A failing model step surfaces as one clear error from LLM.generate and leaves nothing behind."""
import pytest

from serve import LLM, SamplingParams


def test_step_failure_raises_and_frees_everything(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=32, max_num_seqs=1)
    runner = llm.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(batch)

    runner.execute = flaky
    with pytest.raises(RuntimeError, match="internal error"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))
    core = llm.engine.core
    assert not core.has_unfinished() and core.block_manager.num_free_blocks == 32
    runner.execute = real
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_failed_prefill_caches_no_prefix(tiny_models):
    """The scheduler registers a prefill's blocks in the prefix cache when it schedules them; a
    step that fails must take them back, or the next request with that prompt would read garbage."""
    prompt = list(range(5, 5 + 40))  # 2 full blocks of 16 and a partial one
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=32,
               enable_prefix_caching=False).generate([prompt], greedy)[0].token_ids
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=32)
    runner = llm.engine.runner
    real = runner.execute

    def fail(batch):
        raise RuntimeError("injected")

    runner.execute = fail
    with pytest.raises(RuntimeError, match="internal error"):
        llm.generate([prompt], greedy)
    assert not llm.engine.core.block_manager.cached
    runner.execute = real
    assert llm.generate([prompt], greedy)[0].token_ids == want
