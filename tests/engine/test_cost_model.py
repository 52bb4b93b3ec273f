"""The step cost model (engine/cost_model.py): interpolation, the prompt budget, multi-step choice."""
from __future__ import annotations

import pytest

from engine.cost_model import MIN_PROMPT_TOKENS, STALL_FACTOR, StepCostModel

# an 8B-like GPU: flat to the ridge (~256 rows), then 20 us a row
ROWS = (16, 64, 128, 256, 512, 1024, 2048)
MS = (5.0, 5.0, 5.1, 5.3, 10.5, 20.6, 41.0)


def model(**kw) -> StepCostModel:
    return StepCostModel(ROWS, MS, kv_ms_per_token=0.0001, max_tokens=8192, **kw)


def test_forward_interpolates_and_extrapolates():
    m = model()
    assert m.forward(1) == 5.0 and m.forward(64) == 5.0
    assert m.forward(384) == pytest.approx((5.3 + 10.5) / 2)
    assert m.forward(4096) == pytest.approx(41.0 + (41.0 - 20.6) / 1024 * 2048)


def test_noise_never_makes_more_rows_cheaper():
    m = StepCostModel((16, 64, 128), (5.0, 4.8, 5.2), 0.0, 1024)
    assert m.forward_ms == (5.0, 5.0, 5.2)
    with pytest.raises(ValueError):
        StepCostModel((64, 16), (1.0, 2.0), 0.0, 1024)


def test_budget_keeps_the_forward_within_the_stall_factor():
    m = model()
    decodes, context = 64, 64 * 512
    budget = m.prompt_budget(decodes, context)
    assert m.forward(decodes + budget) <= STALL_FACTOR * m.forward(decodes) + 1e-9
    assert m.forward(decodes + budget + 8) > STALL_FACTOR * m.forward(decodes)
    assert 256 < decodes + budget < 1024  # past the ridge: the flat part is free, the rest costs
    assert m.prompt_budget(decodes, 0) == budget  # the decodes' attention comes on top, whatever it is


def test_no_decodes_means_the_whole_step_and_a_target_is_honoured():
    m = model()
    assert m.prompt_budget(0, 0) == 8192
    tight = model(max_step_ms=6.0)
    b = tight.prompt_budget(64, 1000)
    assert tight.step_ms(64, 1000, b) <= 6.0 + 1e-9 and b >= MIN_PROMPT_TOKENS
    # a target below the decodes' own step: prompts still advance
    assert model(max_step_ms=0.1).prompt_budget(64, 0) == MIN_PROMPT_TOKENS
    # never past max_tokens
    assert StepCostModel(ROWS, MS, 0.0, 300).prompt_budget(64, 0) == 300 - 64


def test_largest_mixed_step_and_multi_step_choice():
    m = model()
    assert m.largest_mixed_step(64) == max(d + m.prompt_budget(d, 0) for d in range(1, 65))
    assert m.scheduler_steps(64, 4) == 1  # a 5 ms step dwarfs the host's work
    small = StepCostModel((16, 64, 512), (0.6, 0.7, 1.5), 0.0, 8192)
    assert small.scheduler_steps(64, 4) == 4


def test_the_runner_measures_every_size_and_builds_a_model(tiny_models):
    """The measurement's forwards run (here on the CPU, timed by a stand-in: the GPU times them on
    the device) and make a model the scheduler can use."""
    import torch

    from engine.config import EngineConfig
    from serve import LLM

    runner = LLM.from_config(EngineConfig(model=str(tiny_models["qwen2"]), device="cpu", dtype="float32",
                                          max_num_batched_tokens=300)).engine.runner
    assert runner.cost_model is None  # the CPU schedules without one
    calls = []

    def timer(fn):
        out = fn()
        calls.append(out)
        return 1.0 + 0.01 * len(calls)

    m = runner.measure_step_costs(timer)
    assert m.rows == (16, 64, 128, 256, 300) and m.max_tokens == 300
    logits = calls[-2]  # the 300-token forward: one logit row per chunk of 256
    assert isinstance(logits, torch.Tensor) and logits.shape[0] == 2
    assert m.kv_ms_per_token > 0 and m.prompt_budget(4, 64) >= MIN_PROMPT_TOKENS
