"""Prompt logprobs (SamplingParams.prompt_logprobs, engine/prompt_logprobs.py): every prompt token's
logprob, rank and top tokens against transformers' log-softmax of the same prompt, through whole and
chunked prefills, sync and async steps, preemption, and a prompt already in the prefix cache."""
import functools
import pickle
import random
from array import array

import pytest
import torch

from engine.prompt_logprobs import prompt_rows
from scheduler.request import PromptChunk, PromptLogprobs, SamplingParams, ScheduledSeq, Sequence, TokenLogprob
from serve import LLM
from tests.engine.test_logit_adjust import check_drained
from tests.models import VOCAB


@functools.cache
def _hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_prompt_logprobs(path, prompt):
    """[len(prompt) - 1, V] float32: row j scores prompt token j + 1."""
    model = _hf_model(str(path))
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def check_against(want: torch.Tensor, prompt: list[int], got: list, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for j, lp in enumerate(got[1:]):
        row = want[j]
        assert lp.token_id == prompt[j + 1]
        assert lp.logprob == pytest.approx(float(row[prompt[j + 1]]), abs=2e-4)
        v = row[prompt[j + 1]]
        assert 1 + int((row > v + 1e-4).sum()) <= lp.rank <= 1 + int((row > v - 1e-4).sum())  # ties within rounding
        assert len(lp.top) == k
        values, ids = row.topk(max(k, 1))
        for (tid, v), wv in zip(lp.top, values.tolist()):
            assert v == pytest.approx(wv, abs=2e-4)
            assert float(row[tid]) == pytest.approx(v, abs=2e-4)  # ids may swap only at ties


def _prompts(seed):
    rng = random.Random(seed)
    lengths = [1, 2, 7, 23, 40, 61]
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kw", [
    {"async_scheduling": True},
    {"async_scheduling": False},
    {"async_scheduling": True, "max_num_batched_tokens": 16},
    {"async_scheduling": True, "num_kv_blocks": 7, "max_tokens": 30},
], ids=["async", "sync", "chunked", "preempt"])
def test_prompt_logprobs_equal_transformers(tiny_models, kw):
    path = tiny_models["llama"]
    prompts = _prompts(0)
    ks = [0, 3, 5, 20, None, 2]
    kw = dict(kw)
    n = kw.pop("max_tokens", 6)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, prompt_logprobs=k) for k in ks]
    llm = LLM(str(path), dtype="float32", device="cpu", **kw)
    outs = llm.generate(prompts, params)
    check_drained(llm, preempted="num_kv_blocks" in kw)
    plain = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    for prompt, k, o, p in zip(prompts, ks, outs, plain):
        assert o.token_ids == p.token_ids  # asking for them changes nothing generated
        if k is None:
            assert o.prompt_logprobs is None
            continue
        check_against(hf_prompt_logprobs(path, prompt), prompt, o.prompt_logprobs, k)


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_models):
    path = tiny_models["qwen2"]
    prompt = _prompts(1)[-1]
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8)
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))  # its blocks now in the prefix cache
    hits = llm.engine.core.scheduler.prefix_cache_hits
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4))[0]
    assert llm.engine.core.scheduler.prefix_cache_hits == hits
    check_against(hf_prompt_logprobs(path, prompt), prompt, out.prompt_logprobs, 4)
    # without them the cache is read as before
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
    assert llm.engine.core.scheduler.prefix_cache_hits > hits


def test_rows_of_a_step():
    """A chunk's rows score the tokens after them; the last prompt position samples instead."""
    a = Sequence(0, [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=2))
    b = Sequence(1, [4, 4, 4], SamplingParams())
    c = Sequence(2, [1, 2, 3, 4], SamplingParams(prompt_logprobs=0))
    d = Sequence(3, [3, 1], SamplingParams(prompt_logprobs=1))
    d.token_ids.append(9)  # generated: its prompt's logprobs were handed out
    items = [ScheduledSeq(d, 2, 1), ScheduledSeq(a, 2, 3), ScheduledSeq(b, 0, 3), ScheduledSeq(c, 0, 2)]
    rows = prompt_rows(items)
    # a: positions 2, 3 score tokens 3, 4 (position 4 samples); c: positions 0, 1 score tokens 1, 2
    assert rows.rows == [1, 2, 7, 8]
    assert rows.targets == [8, 9, 2, 3]
    assert rows.spans == [(1, 2), (3, 2)]
    assert rows.top == 2
    assert prompt_rows(items[:1] + items[2:3]) is None


def test_arrays_read_as_a_list_of_entries():
    out = PromptLogprobs([7, 8, 9, 10], 2)
    assert list(out) == [None] * 4 and len(out) == 4
    out.fill(1, PromptChunk(array("f", [-1.5, -0.25]), array("q", [3, 1]), array("q", [4, 5, 9, 2]),
                            array("f", [-0.5, -1.0, -0.25, -3.0])))
    assert out[0] is None and out[3] is None
    assert out[1] == TokenLogprob(8, -1.5, [(4, -0.5), (5, -1.0)], 3)
    assert out[-2] == TokenLogprob(9, -0.25, [(9, -0.25), (2, -3.0)], 1)
    assert out[1:3] == [out[1], out[2]]
    out.fill(2, PromptChunk(array("f", [-2.0]), array("q", [4]), array("q", [1, 1]), array("f", [-1.0, -1.0])))
    assert out[2].logprob == -2.0 and out[2].rank == 4  # a row computed again replaces the old one
    assert pickle.loads(pickle.dumps(out))[2] == out[2]  # on its way to the API process


def test_params_bounds():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.gpu
def test_gpu_prompt_logprobs_equal_transformers(tiny_models):
    """On the GPU: whole-step graphs, piecewise graphs and eager steps, chunked, with decodes beside."""
    path = tiny_models["llama"]
    prompts = _prompts(2) * 2
    ks = [0, 3, 5, 20, None, 2] * 2
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=k) for k in ks]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=48)
    assert llm.engine.runner.steps is not None and llm.engine.runner.piecewise is not None
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for prompt, k, o, p in zip(prompts, ks, outs, plain):
        assert o.token_ids == p.token_ids
        if k is not None:
            check_against(hf_prompt_logprobs(path, prompt).cpu(), prompt, o.prompt_logprobs, k)
