"""The step cost model (engine/cost_model.py): buckets, the prompt budget, multi-step choice."""
from __future__ import annotations

import pytest

from engine.cost_model import MIN_PROMPT_TOKENS, STALL_FACTOR, StepCostModel

# an 8B-like GPU: flat to the ridge (~256 rows), then 20 us a row
ROWS = (16, 64, 128, 256, 512, 1024, 2048)
MS = (5.0, 5.0, 5.1, 5.3, 10.5, 20.6, 41.0)


def model(**kw) -> StepCostModel:
    return StepCostModel(ROWS, MS, kv_ms_per_token=0.0001, max_tokens=8192, **kw)


def test_a_step_pays_its_bucket_and_beyond_the_last_slope():
    m = model()
    assert m.forward(1) == 5.0 and m.forward(64) == 5.0 and m.forward(65) == 5.1
    assert m.forward(300) == 10.5  # padded to 512 rows
    assert m.forward(4096) == pytest.approx(41.0 + 41.0 / 2048 * 2048)  # 2,048 rows' mean: steeper than the last pair


def test_past_the_largest_bucket_at_least_its_mean_per_row():
    """Two last buckets timed nearly level (an H100's 1,920 and 2,048 rows, 46.88 and 47.38 ms)
    would make a step past them almost free: a user's 95 ms target would have allowed ~14,000
    rows (~320 ms) where 4,096 take ~95 ms at 2,048 rows' mean."""
    m = StepCostModel((1024, 1920, 2048), (22.7, 46.88, 47.38), 0.0, 16384, max_step_ms=94.76)
    assert m.forward(4096) == pytest.approx(47.38 * 2)
    assert m.rows_within(94.76) == 4096 and m.prompt_budget(64, 0) == 4096 - 64


def test_a_bucket_that_a_larger_one_beats_is_dropped():
    # measured on an H100 (Llama-3-8B): 832 rows took longer than 1,024
    m = StepCostModel((512, 768, 832, 896, 1024), (10.9, 16.1, 21.0, 20.1, 19.0), 0.0, 4096)
    assert m.buckets == (512, 768, 1024) and m.dominated == frozenset({832, 896})
    assert m.forward(800) == 19.0  # pads to 1,024, the faster
    assert m.rows_within(19.0) == 1024 and m.rows_within(18.0) == 768 and m.rows_within(10.0) == 0
    assert m.rows_within(20.5) > 1024  # past the last bucket: its slope
    with pytest.raises(ValueError):
        StepCostModel((64, 16), (1.0, 2.0), 0.0, 1024)


def test_budget_keeps_the_forward_within_the_stall_factor():
    m = model()
    decodes, context = 64, 64 * 512
    budget = m.prompt_budget(decodes, context)
    assert m.forward(decodes + budget) <= STALL_FACTOR * m.forward(decodes) + 1e-9
    assert m.forward(decodes + budget + 1) > STALL_FACTOR * m.forward(decodes)
    assert decodes + budget == 512  # a whole bucket: no row of the step is padding
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


def test_a_pipeline_stage_paces_its_prompts_while_the_cache_binds():
    # 20 us a row at 2,048 rows: the weights' 5 ms read is the compute of 250 rows, so the ridge is 128
    stage = model(pipelined=True)
    assert stage.ridge_rows() == 128
    # the cache holds prompts back: the step takes the ridge's rows or the demand, the larger
    assert stage.prompt_budget(64, 0, demand=10) == 128 - 64
    assert stage.prompt_budget(64, 0, demand=100) == 256 - 64  # a whole bucket: 164 rows pad to 256
    # never past the stall factor's limit
    assert stage.prompt_budget(64, 0, demand=5000) == model().prompt_budget(64, 0) == 512 - 64
    # prompts that wait for compute, not for blocks: the stall factor's larger steps admit them faster
    assert stage.prompt_budget(64, 0) == 512 - 64
    # one GPU's demand is the backlog of waiting prompts: it only ever raises the stall factor's limit
    assert model().prompt_budget(64, 0, demand=10) == 512 - 64
    # decodes past the ridge: the demand, in whole buckets (the rows to the bucket's end are free)
    assert stage.prompt_budget(1000, 0, demand=10) == 24
    # a user's target overrides the rule
    assert model(pipelined=True, max_step_ms=10.5).prompt_budget(64, 0, demand=10) == 512 - 64
    # the graphs are sized by the largest budget
    assert stage.largest_mixed_step(64) == model().largest_mixed_step(64)


def test_one_gpu_steps_take_the_backlog_where_the_stall_factor_allows_less():
    # a 4-bit-like curve: few rows are cheap, prompt steps are not (H200, Llama-3-8B, 2026-11-28), 512
    # rows made slower so that no step carries prompts much more cheaply than another (AMORTIZE)
    m = StepCostModel((16, 32, 64, 128, 256, 512), (2.9, 3.2, 5.1, 7.6, 13.4, 26.0), 0.0, 8192)
    assert m.amortizing_rows(12) == 64
    # 12 decodes alone: 2.5 x 2.9 ms holds a 64-row step, ~4 prompt tokens per decode
    assert m.prompt_budget(12, 0) == 64 - 12
    # a backlog of 256 prompt tokens a step: its whole bucket (268 rows pad to 512)
    assert m.prompt_budget(12, 0, demand=256) == 512 - 12
    # never past max_tokens
    assert StepCostModel(m.rows, m.forward_ms, 0.0, 300).prompt_budget(12, 0, demand=256) == 300 - 12
    # a user's target is kept, backlog or not
    capped = StepCostModel(m.rows, m.forward_ms, 0.0, 8192, max_step_ms=8.0)
    assert capped.prompt_budget(12, 0, demand=256) == capped.prompt_budget(12, 0) == 128 - 12


def test_prompt_steps_amortize_a_large_fixed_part():
    # decode rows are cheap, a prompt step pays ~10 ms (every weight dequantized) + 20 us a row
    rows = (16, 32, 64, 128, 256, 512, 1024, 2048)
    m = StepCostModel(rows, (2.0, 2.2, 3.0, 12.6, 15.1, 20.2, 30.5, 51.0), 0.0, 8192)
    # 64 decodes: their step's extra rows cost 150, 63, 38, 29 and 24 us a row at 128 to 2,048 rows;
    # 1,024 is the first within AMORTIZE of the cheapest, where the stall factor held 64 (7.5 ms)
    assert m.amortizing_rows(64) == 1024
    assert m.rows_within(STALL_FACTOR * m.forward(64)) == 64
    assert m.prompt_budget(64, 0) == m.prompt_budget(64, 0, demand=256) == 1024 - 64
    # 12 decodes: the stall factor's 64-row step (5 ms) carries prompts at 19 us a token, as cheap as any
    assert m.amortizing_rows(12) == 64 and m.prompt_budget(12, 0) == 64 - 12
    # a user's target is kept
    assert StepCostModel(rows, m.forward_ms, 0.0, 8192, max_step_ms=8.0).prompt_budget(64, 0) == MIN_PROMPT_TOKENS
    # a near-linear curve (bf16 past the ridge): the stall factor's steps already cost within AMORTIZE
    flat = model()
    assert flat.forward(flat.amortizing_rows(64)) <= STALL_FACTOR * flat.forward(64)
    # past the largest bucket nothing measured compares: the stall factor's step
    assert flat.amortizing_rows(4096) == flat.rows_within(STALL_FACTOR * flat.forward(4096))
    # a coarse curve whose stall step carries its prompts nearly free keeps it
    coarse = StepCostModel((16, 256, 2048), (5.0, 6.0, 40.0), 0.0, 8192)
    assert coarse.amortizing_rows(64) == 256 and coarse.amortizing_rows(250) == 2048


# Llama-3-8B's forwards as `serve run` measured them (bf16, dummy weights; bench/results/amortize-h200-2026-11-29.json
# call 3 and overlap-diagnostics-h100-2026-11-27.json), and the 4-bit checkpoint's on the H200 (same day)
MEASURED_ROWS = (16, 32, 64, 128, 256, 384, 512, 576, 640, 704, 768, 832, 896, 960, 1024, 1152, 1280, 1408, 1536,
                 1664, 1792, 1920, 2048)
BF16_H200 = (4.43, 5.27, 4.67, 5.51, 7.85, 10.29, 12.27, 15.63, 15.13, 19.0, 18.75, 20.87, 20.75, 23.18, 22.13, 26.35,
             27.22, 33.01, 34.87, 38.23, 38.6, 43.97, 45.7)
BF16_H100 = (5.96, 6.77, 6.07, 7.07, 8.48, 10.81, 13.32, 14.97, 15.6, 18.27, 18.68, 23.62, 22.3, 23.42, 23.78, 26.99,
             29.5, 33.2, 37.34, 39.46, 41.19, 45.41, 44.93)
INT4_H200 = (2.89, 3.27, 5.3, 8.5, 13.33, 15.74, 17.99, 21.41, 21.85, 24.26, 25.76, 27.55, 26.81, 29.25, 27.78, 32.79,
             33.97, 39.14, 40.86, 44.75, 46.45, 50.77, 49.83)


def test_measured_curves_amortize_only_the_4_bit_one():
    """bf16 budgets stay the stall factor's at every decode count; the 4-bit curve's steps of 64
    decodes grow to 896 rows (served 1.15x the tokens/s)."""
    for ms in (BF16_H200, BF16_H100):
        m = StepCostModel(MEASURED_ROWS, ms, 0.0, 8192)
        for d in range(1, 257):
            assert m.forward(m.amortizing_rows(d)) <= STALL_FACTOR * m.forward(d) + 1e-9, d
    m = StepCostModel(MEASURED_ROWS, INT4_H200, 0.0, 8192)
    assert m.rows_within(STALL_FACTOR * m.forward(64)) == 128 and m.amortizing_rows(64) == 896
    assert m.prompt_budget(64, 0) == 896 - 64


def test_largest_mixed_step_and_multi_step_choice():
    m = model()
    assert m.largest_mixed_step(64) == max(d + m.prompt_budget(d, 0) for d in range(1, 65))
    assert m.scheduler_steps(64, 4) == 1  # a 5 ms step dwarfs the host's work
    small = StepCostModel((16, 64, 512), (0.6, 0.7, 1.5), 0.0, 8192)
    assert small.scheduler_steps(64, 4) == 4
    # a 3.5 ms step (Llama-3-8B in FP8, or at TP=2) hides the host's work: single steps, a prompt budget
    assert StepCostModel((16, 64, 512), (3.3, 3.5, 9.0), 0.0, 8192).scheduler_steps(64, 4) == 1


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

    def timer(fn, head=None):
        assert head is None  # no GPU to hold at its power limit
        out = fn()
        calls.append(out)
        return 1.0 + 0.01 * len(calls)

    m = runner.measure_step_costs(timer)
    assert m.rows == (16, 32, 64, 128, 256, 300) and m.max_tokens == 300
    logits = calls[-2]  # the 300-token forward: one logit row per chunk of 256
    assert isinstance(logits, torch.Tensor) and logits.shape[0] == 2
    assert m.kv_ms_per_token > 0 and m.prompt_budget(4, 64) >= MIN_PROMPT_TOKENS


def test_compute_bound_sizes_are_timed_at_the_power_limit(tiny_models):
    """From the first size whose forward takes over HOT_ABOVE times the smallest one's, the GPU is
    first heated and every size is timed with the heater's matmuls as its head start; the sizes
    before stay cold (decode steps run below the power limit)."""
    from engine.config import EngineConfig
    from engine.runner import HEAT_MS, HOT_ABOVE
    from serve import LLM

    runner = LLM.from_config(EngineConfig(model=str(tiny_models["qwen2"]), device="cpu", dtype="float32",
                                          max_num_batched_tokens=300)).engine.runner

    class Heater:
        def __init__(self):
            self.heats = []

        def run(self, ms):
            self.heats.append(ms)

    heater = Heater()
    cold = {16: 1.0, 32: 1.0, 64: 1.1, 128: 1.1 * HOT_ABOVE + 0.1, 256: 3.0, 300: 3.5, "copy": 0.1}
    timed = []
    runner._forward_fn = lambda n, pool: (lambda: n)  # each forward says its size

    def timer(fn, head=None):
        out = fn()
        n = out if isinstance(out, int) else "copy"
        timed.append((n, head is not None))
        return cold[n] * (1.2 if head is not None else 1.0)

    m = runner.measure_step_costs(timer, heater)
    # 128 decides (cold), is timed again hot, and so is every larger size; the copy stays cold
    assert timed == [(16, False), (32, False), (64, False), (128, False), (128, True), (256, True), (300, True),
                     ("copy", False)]
    assert heater.heats == [HEAT_MS]  # once; the head starts are the timer's to queue
    assert m.forward_ms == (1.0, 1.0, 1.1, *(1.2 * cold[n] for n in (128, 256, 300)))


def test_the_runner_keeps_its_measurement_on_disk(tiny_models, tmp_path, monkeypatch):
    """A second start with the same conditions reads the curve instead of timing it; other
    conditions (here another configuration), or a damaged file, measure afresh."""
    from engine import cost_cache
    from engine.config import EngineConfig
    from serve import LLM

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    runner = LLM.from_config(EngineConfig(model=str(tiny_models["qwen2"]), device="cpu", dtype="float32",
                                          max_num_batched_tokens=300)).engine.runner
    measured = []

    def measure(timer=None):
        measured.append(1)
        return StepCostModel((16, 64, 300), (1.0, 1.5 + len(measured), 4.0), 0.001, 300)

    conditions = {"gpu": "stand-in", "engine": "a"}
    monkeypatch.setattr(runner, "measure_step_costs", measure)
    monkeypatch.setattr(runner, "_cost_conditions", lambda: dict(conditions))
    early = []  # the compile pass that overlaps a measurement: not run for a stored curve
    first = runner.step_costs(early=lambda: early.append(1))
    again = runner.step_costs(early=lambda: early.append(1))
    assert len(measured) == 1 and again == first and again.forward_ms == (1.0, 2.5, 4.0) and early == [1]
    conditions["engine"] = "b"
    assert runner.step_costs().forward_ms == (1.0, 3.5, 4.0) and len(measured) == 2
    [path] = [p for p in tmp_path.iterdir() if cost_cache.cost_key(conditions) == p.name]
    path.write_text('{"version": 1, "rows": [16], "forward_ms": "x"}')
    assert runner.step_costs().forward_ms == (1.0, 4.5, 4.0) and len(measured) == 3
    path.write_text("not json")
    assert runner.step_costs() is not None and len(measured) == 4


def test_roofline_model_reads_the_weights_once_then_turns_compute_bound():
    # 1 GB of weights at 1 TB/s (1 ms); 2 GFLOP a row at 1 PFLOP/s: the ridge at 500 rows
    m = StepCostModel.roofline([16, 256, 512, 1024, 2048], 10**9, 2e9, 0, 1e12, 1e15, 8192)
    assert m.forward(16) == m.forward(256) == pytest.approx(1.0)
    assert m.forward(1024) == pytest.approx(2.048) and m.forward(2048) == pytest.approx(4.096)
    # 2.5x a 256-row decode step's forward: the largest bucket within 2.5 ms is 1,024 rows
    assert m.largest_mixed_step(256) == 1024


def test_host_bound_rows_is_the_largest_bucket_under_four_host_rounds():
    # 0.5B-like: flat at 2 ms, 4 ms at 512 rows
    m = StepCostModel((16, 64, 256, 512, 1024), (2.0, 2.1, 2.5, 4.0, 7.9), 0.0, 8192)
    assert m.host_bound_rows() == 256  # 512 rows take 4 ms: the GPU paces them
    assert model().host_bound_rows() == 0  # the 8B-like GPU: 5 ms at 16 rows already


class FakeTimedRuns:
    """once(lead_ms) for device_median: a forward of `device` ms whose launches take `host` ms of
    the host's time (`slow` for the first calls: the host busy with something else); where the
    launches outlast the head start the device waits for them, and so does the measurement. With
    sync, fn waits for the device itself, so its queueing always outlasts the head start."""

    def __init__(self, device: float, host: float, slow: float = 0.0, slow_calls: int = 0, sync: bool = False):
        self.device, self.host, self.slow, self.slow_calls, self.sync = device, host, slow, slow_calls, sync
        self.leads: list[float] = []

    def __call__(self, lead_ms: float) -> tuple[float, float]:
        self.leads.append(lead_ms)
        host = self.slow if len(self.leads) <= self.slow_calls else self.host
        if self.sync:
            return self.device, lead_ms + self.device
        return max(self.device, host - lead_ms), host


def test_a_host_slowed_for_a_while_gets_a_longer_head_start():
    from engine.runner import LEAD_GROWTH, device_median

    runs = FakeTimedRuns(device=8.4, host=5.0, slow=29.6, slow_calls=3)
    assert device_median(runs, 8.5, 5) == 8.4
    # the first sample's launches used up 8.5 ms: again at 68 ms, which the rest keep
    assert runs.leads == [8.5] + [8.5 * LEAD_GROWTH] * 5
    quiet = FakeTimedRuns(device=8.4, host=5.0)
    assert device_median(quiet, 8.5, 5) == 8.4 and quiet.leads == [8.5] * 5


def test_a_run_that_waits_for_the_device_is_timed_as_it_runs():
    from engine.runner import device_median

    runs = FakeTimedRuns(device=3.0, host=1.0, sync=True)
    assert device_median(runs, 2.0, 3) == 3.0
    assert runs.leads[:3] == [2.0, 16.0, 0.0] and set(runs.leads[3:]) == {0.0} and len(runs.leads) == 5


def test_the_ranks_agree_on_the_head_start():
    from engine.runner import device_median

    # another rank's host fell behind (anywhere: the ranks' max): this rank retries with it
    calls = []

    def anywhere(flag: bool) -> bool:
        calls.append(flag)
        return len(calls) == 1 or flag

    runs = FakeTimedRuns(device=4.0, host=1.0)
    assert device_median(runs, 2.0, 3, anywhere) == 4.0
    assert runs.leads == [2.0, 16.0, 16.0, 16.0]
