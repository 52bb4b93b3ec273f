"""Priorities (SamplingParams.priority, vLLM's: lower runs sooner): waiting sequences line up by
priority then arrival; one of higher priority takes the place of a lower running one where it
could not start otherwise (max_num_seqs, or the cache), and every output stays the one it has
alone (greedy, float32 on the CPU); the request field reaches the engine."""
from __future__ import annotations

import pytest

from serve import LLM, SamplingParams
from tests.engine.test_equal_transformers import make_prompts

CPU = dict(dtype="float32", device="cpu")


def greedy(n: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, priority=priority)


def run(core, until_done: bool = True) -> tuple[list[int], list[int]]:
    """Step the core: (seq ids in the order of their first token, in the order they finished)."""
    first, done = [], []
    while core.has_unfinished():
        for out in core.step():
            if out.num_output_tokens == len(out.new_token_ids) and out.new_token_ids:
                first.append(out.seq_id)
            if out.finished:
                done.append(out.seq_id)
        if not until_done:
            break
    return first, done


@pytest.fixture(scope="module")
def alone(tiny_models):
    """Each prompt's greedy tokens, served alone."""
    prompts = make_prompts(4)
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=64, **CPU)
    return prompts, [o.token_ids for o in llm.generate(prompts, greedy(24))]


def test_waiting_sequences_line_up_by_priority_then_arrival(tiny_models, alone):
    prompts, want = alone
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=64, max_num_seqs=1, **CPU)
    core = llm.engine.core
    seqs = [core.add_request(p, greedy(24, priority)) for p, priority in zip(prompts, (2, 1, 2, 1, 0, 1))]
    first, done = run(core)
    by_id = {s.seq_id: i for i, s in enumerate(seqs)}
    assert [by_id[i] for i in first] == [4, 1, 3, 5, 0, 2] == [by_id[i] for i in done]
    assert [s.token_ids[s.num_prompt_tokens:] for s in seqs] == want
    assert core.stats.num_preemptions == 0


def test_a_higher_priority_takes_a_running_sequences_place(tiny_models, alone):
    """max_num_seqs 1: the running sequence of priority 1 makes way for one of priority 0 and
    finishes after it, recomputed; one of the same priority waits its turn."""
    prompts, want = alone
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=64, max_num_seqs=1, **CPU)
    core = llm.engine.core
    low = core.add_request(prompts[5], greedy(24, 1))
    run(core, until_done=False)
    run(core, until_done=False)
    same = core.add_request(prompts[4], greedy(24, 1))
    high = core.add_request(prompts[3], greedy(24, 0))
    first, done = run(core)
    assert done == [high.seq_id, low.seq_id, same.seq_id]
    assert low.num_preemptions == 1 and high.num_preemptions == same.num_preemptions == 0
    assert [s.token_ids[s.num_prompt_tokens:] for s in (low, same, high)] == [want[5], want[4], want[3]]
    core.scheduler.check_integrity()


def test_a_higher_priority_takes_the_cache(tiny_models, alone):
    """Blocks, not slots: 5 blocks of 16 hold the running sequence (50 + 24 tokens) once its output
    passes 64 tokens; a prompt of higher priority then preempts it, one of lower priority waits."""
    prompts, want = alone
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=5, **CPU)
    core = llm.engine.core
    low = core.add_request(prompts[5], greedy(24, 3))
    while core.block_manager.num_free_blocks:  # until its output takes the last block
        run(core, until_done=False)
    lower = core.add_request(prompts[4], greedy(24, 5))
    run(core, until_done=False)
    assert lower.num_computed_tokens == 0  # no room, and no right to take it
    high = core.add_request(prompts[2], greedy(24, -1))
    first, done = run(core)
    assert done == [high.seq_id, low.seq_id, lower.seq_id]
    assert low.num_preemptions == 1 and lower.num_preemptions == high.num_preemptions == 0
    assert [s.token_ids[s.num_prompt_tokens:] for s in (low, lower, high)] == [want[5], want[4], want[2]]
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_the_request_field_reaches_the_engine(tiny_models):
    from pydantic import ValidationError
    from transformers import AutoTokenizer

    from serve.prompts import RequestPlanner
    from serve.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
    from serve.server_config import ServerConfig

    planner = RequestPlanner(AutoTokenizer.from_pretrained(tiny_models["llama"]), 384, 512, ServerConfig())
    assert planner.completion(CompletionRequest(prompt=[5, 6], priority=-3)).params[0].priority == -3
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "priority": 7})
    assert planner.chat(chat).params[0].priority == 7
    assert planner.encode_here(planner.embedding_draft(EmbeddingRequest(input="hi", priority=2), "last")
                               ).params[0].priority == 2
    assert planner.completion(CompletionRequest(prompt=[5])).params[0].priority == 0
    with pytest.raises(ValidationError, match="priority"):
        CompletionRequest.model_validate({"prompt": "hi", "priority": "high"})
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=1.5)
