"""Constrained decoding across ranks (gloo on the CPU): every rank that samples fills its own masks
from the same tokens, so tensor-parallel (with and without async scheduling, whose masks wait for
the token before them: the followers get it with the step's finish) and pipeline-parallel engines
give one process's constrained tokens; every output is in its grammar."""
from __future__ import annotations

import re

import pytest
import torch

from engine.grammar import choice_grammar, json_schema_grammar, regex_grammar
from serve import LLM, SamplingParams

CPU = dict(dtype="float32", device="cpu")
PATTERN = r"[a-z]{2,6}( [0-9]{1,3}){2}"
SENTENCE = r"[a-z ]{30,60}\."
CHOICES = ["Paris", "Berlin is far", "Tokyo"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "yz"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def constrained_mix() -> list[SamplingParams]:
    # the choice rows end (the grammar done, then EOS) while async scheduling has their next step in
    # flight: a row rank 0 then leaves unmasked, and so must the others
    return [SamplingParams(max_tokens=40, temperature=0, grammar=regex_grammar(PATTERN)),
            SamplingParams(max_tokens=40, temperature=0.9, seed=3, grammar=regex_grammar(PATTERN)),
            SamplingParams(max_tokens=40, temperature=0.9, seed=5, grammar=choice_grammar(CHOICES)),
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=60, temperature=0.7, seed=9, grammar=json_schema_grammar(SCHEMA)),
            SamplingParams(max_tokens=40, temperature=0, grammar=choice_grammar(CHOICES))]


def prompts(n: int) -> list[list[int]]:
    return [[5 + i, 40, 41, 42 + i] + [60 + 3 * i] * (i % 3) for i in range(n)]


def run(model: str, params: list[SamplingParams], ps: list[list[int]] | None = None, where: dict = CPU,
        **kw) -> list[tuple[list[int], str]]:
    with LLM(model, **where, **kw) as llm:
        outs = llm.generate(ps or prompts(len(params)), params)
        core = llm.engine.core
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    for o, p in zip(outs, params):
        if p.grammar is None:
            assert len(o.token_ids) == p.max_tokens
        elif o.finish_reason == "stop":  # a grammar finished within max_tokens is matched whole
            text = o.text
            assert (re.fullmatch(PATTERN, text) or re.fullmatch(SENTENCE, text) or text in CHOICES
                    or (text.startswith('{"n":') and text.endswith("}"))), text
    return [(o.token_ids, o.finish_reason) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_constrained_equals_one_rank(tiny_models, async_scheduling):
    model = str(tiny_models["llama"])
    kw = dict(num_kv_blocks=64, async_scheduling=async_scheduling)
    one = run(model, constrained_mix(), **kw)
    assert sum(reason == "stop" for _, reason in one) >= 3
    assert run(model, constrained_mix(), tensor_parallel_size=2, **kw) == one


def test_tp2_constrained_with_preemption_equals_one_rank(tiny_models):
    """A cache too small for every sequence: preempted constrained rows keep their tokens, and the
    followers' matchers stay in step with rank 0's."""
    model = str(tiny_models["llama"])
    params = [SamplingParams(max_tokens=70, temperature=0.9, seed=i, grammar=regex_grammar(SENTENCE))
              for i in range(4)]
    ps = [[5 + i] * 20 for i in range(4)]
    kw = dict(num_kv_blocks=10, block_size=16, async_scheduling=True)
    one = run(model, params, ps, **kw)
    with LLM(model, tensor_parallel_size=2, **CPU, **kw) as llm:
        two = llm.generate(ps, params)
        assert llm.engine.core.stats.num_preemptions > 0
    assert [(o.token_ids, o.finish_reason) for o in two] == one


def test_pp2_constrained_equals_one_stage(tiny_models):
    model = str(tiny_models["qwen2"])
    one = run(model, constrained_mix(), num_kv_blocks=64)
    assert run(model, constrained_mix(), pipeline_parallel_size=2, num_kv_blocks=64) == one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_constrained_equal_one(tiny_models):
    """On two GPUs in float32, async scheduling and the graphs on (the defaults): one GPU's tokens."""
    model = str(tiny_models["llama"])
    gpu = dict(dtype="float32", device="cuda")
    one = run(model, constrained_mix(), where=gpu, num_kv_blocks=64)
    assert run(model, constrained_mix(), where=gpu, num_kv_blocks=64, tensor_parallel_size=2) == one
