"""lab/sim.py: the real scheduler against a step-time model, one GPU and a pipeline of stages."""
from __future__ import annotations

import json

import pytest

from engine.cost_model import StepCostModel
from lab.sim import ceiling, main, simulate, timeline_summary

# one stage of a 70B at PP=2 on H100s, shaped like the served run's steps (2026-11-27): ~26 ms up
# to the ridge, ~0.09 ms a row beyond
STAGE = ((16, 64, 128, 256, 384, 512, 640, 768, 1024, 2048),
         (26.0, 26.5, 28.0, 35.0, 46.0, 58.0, 70.0, 82.0, 105.0, 190.0))


def stage(pipelined: bool) -> StepCostModel:
    return StepCostModel(*STAGE, kv_ms_per_token=55e-6, max_tokens=8192, pipelined=pipelined)


def test_one_gpu_serves_every_request():
    r = simulate(stage(False), 8, 24, 64, 16, overhead_ms=0.0)
    assert r.steps > 16 and r.output_throughput > 0 and r.median_tpot_ms >= 26.0


def test_pacing_prompts_while_the_cache_binds_beats_the_stall_rule():
    """256 clients, a cache of ~72 sequences: prompts start only as sequences end. With the stall
    factor's budget a few micro-batches take the prompts and the rest carry none (each still reads
    the stage's weights); paced to the demand they ride beside every micro-batch's read."""
    kw = dict(overhead_ms=1.5, stages=2, num_blocks=2900)
    stall = simulate(stage(False), 256, 768, 512, 128, **kw)
    paced = simulate(stage(True), 256, 768, 512, 128, **kw)
    assert paced.output_throughput > 1.05 * stall.output_throughput
    # with blocks to spare the rule stays out of the way
    roomy = dict(kw, num_blocks=1 << 20)
    assert simulate(stage(True), 64, 192, 512, 128, **roomy) == simulate(stage(False), 64, 192, 512, 128, **roomy)


def test_the_command_line(capsys, tmp_path):
    args = ["--concurrency", "8", "--num-prompts", "16", "--input-len", "64", "--output-len", "8", "--stages", "2",
            "--num-blocks", "64"]
    assert main(["--forward", "16:26,256:35,2048:190", *args]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out
    # the same curve from a serve bench result (bench/server.py reads it from the server's log)
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"engine_cost_model": {"rows": [16, 256, 2048], "forward_ms": [26, 35, 190]}}))
    assert main(["--forward-from", str(result), *args]) == 0
    assert capsys.readouterr().out == out
    result.write_text(json.dumps({"engine_cost_model": None}))
    with pytest.raises(SystemExit):
        main(["--forward-from", str(result), *args])
    assert "no engine_cost_model" in capsys.readouterr().err


def test_the_ceiling_fills_the_cheapest_bucket_and_bounds_every_schedule():
    # 64 decodes read the weights in 6 ms; each bucket past it costs its rows' compute
    model = StepCostModel((64, 128, 256, 512, 1024), (6.0, 6.5, 8.0, 14.0, 26.0), kv_ms_per_token=0.0,
                          max_tokens=8192)
    top, rows = ceiling(model, 64, 192, 512, 128)
    # 384 steps, 98,304 prompt tokens. 512-row steps: 220 mixed + 164 decode-only = 4.06 s; 256 rows:
    # 512 mixed steps, more than the outputs need, 4.10 s; 1,024 rows: 103 + 281 = 4.36 s; 128 rows: 9.98 s
    assert rows == 512
    mixed = -(-192 * 512 // (512 - 64))
    assert top == pytest.approx(192 * 128 / ((mixed * 14.0 + (384 - mixed) * 6.0) / 1e3))
    for cap in (None, 9.0, 15.0, 27.0):
        capped = StepCostModel(model.rows, model.forward_ms, kv_ms_per_token=0.0, max_tokens=8192, max_step_ms=cap)
        assert simulate(capped, 64, 192, 512, 128, overhead_ms=0.0).output_throughput <= top


def test_requests_reach_the_scheduler_after_the_admission_delay():
    fast = simulate(stage(False), 8, 24, 64, 16, overhead_ms=0.0)
    slow = simulate(stage(False), 8, 24, 64, 16, overhead_ms=0.0, admission_ms=40.0)
    # every request's first token comes at least the delay later, and the loop of clients slows down
    assert slow.median_ttft_ms >= fast.median_ttft_ms + 40.0 - 1e-9
    assert slow.output_throughput < fast.output_throughput


def test_poisson_arrivals_and_ragged_lengths():
    """An open loop below what the GPU serves: throughput follows the arrivals, not the GPU, and the
    first tokens come within a few steps; far above it the closed loop's throughput returns."""
    gpu = StepCostModel((16, 256, 2048), (5.0, 6.0, 40.0), kv_ms_per_token=0.0, max_tokens=8192)
    closed = simulate(gpu, 64, 256, 512, 128, overhead_ms=0.0)
    slow = simulate(gpu, 64, 256, 512, 128, overhead_ms=0.0, request_rate=5.0, range_ratio=0.5, seed=1)
    # 5 requests a second of 128 +- 64 outputs: ~640 tok/s, the 256 arrivals spread over ~51 s
    assert 500 < slow.output_throughput < 800
    assert slow.median_ttft_ms < 4 * 40.0
    # arrivals microseconds apart: the first step takes the first prompt alone, then the loop is closed
    fast = simulate(gpu, 64, 256, 512, 128, overhead_ms=0.0, request_rate=1e6)
    assert fast.output_throughput == pytest.approx(closed.output_throughput, rel=0.1)
    # ragged lengths are drawn once per seed: the same run twice
    assert simulate(gpu, 64, 64, 512, 128, range_ratio=0.5, seed=3) == simulate(gpu, 64, 64, 512, 128,
                                                                             range_ratio=0.5, seed=3)


def test_the_timeline_accounts_for_every_batch():
    """A closed loop's first batch is all prompts; every batch is one kind; their time is the run's
    (no idle gaps in a closed loop without admission delay)."""
    r = simulate(stage(False), 8, 24, 64, 16, overhead_ms=0.0)
    assert len(r.timeline) == r.steps and r.timeline[0][0] == 0 and r.timeline[0][1] > 0
    kinds = timeline_summary(r.timeline)
    assert sum(k["batches"] for k in kinds.values()) == r.steps
    assert sum(k["ms"] for k in kinds.values()) == pytest.approx(24 * 16 / r.output_throughput * 1e3)
    assert kinds["decode_only"]["mean_prompt_tokens"] == 0 and kinds["prompt_only"]["mean_decodes"] == 0
