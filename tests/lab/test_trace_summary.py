"""PAGEDSERVE_STEP_TRACE (scheduler/trace.py) and its summary: one row per engine step, its phases."""
from __future__ import annotations

import json

from lab import trace_summary


def test_step_trace_of_an_offline_run(tiny_models, tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", str(path))
    from scheduler.request import SamplingParams
    from serve.llm import LLM

    llm = LLM(str(tiny_models["llama"]), max_num_batched_tokens=32)
    llm.generate([[5] * 20, [7] * 20, [9] * 20], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.engine.core.trace.flush()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == llm.engine.core.stats.num_steps
    assert sum(r["tokens"] for r in rows) == 3 * 20 + 3 * 3
    for r in rows:
        assert r["t0"] <= r["t_sched"] <= r["t_end"]
    res = trace_summary.summarize(rows)
    kinds = {k for k in ("decode", "mixed", "prefill") if k in res}
    assert "decode" in kinds and kinds & {"mixed", "prefill"}
    assert sum(res[k]["steps"] for k in kinds) == len(rows)
    assert res["decode"]["schedule_ms"]["sum"] >= 0
    assert res["held_steps"] == 0 and all(r["held"] == 0 for r in rows)  # the prefill hold is off by default


def test_device_times_go_to_the_step_that_was_collected():
    # a row's prev_* fields are the times of the step the previous row launched
    rows = [{"t0": 0.0, "t_sched": 0.1, "t_end": 1.0, "seqs": 2, "decodes": 0, "tokens": 40},
            {"t0": 1.0, "t_sched": 1.1, "t_end": 2.0, "seqs": 2, "decodes": 2, "tokens": 2,
             "prev_gpu_ms": 3.0, "prev_idle_ms": 0.5},
            {"t0": 2.0, "t_end": 2.5, "prev_gpu_ms": 1.25, "prev_idle_ms": 0.0}]  # the drain row
    res = trace_summary.summarize(rows)
    assert res["prefill"]["gpu_ms"]["sum"] == 3.0 and res["prefill"]["idle_ms"]["sum"] == 0.5
    assert res["decode"]["gpu_ms"]["sum"] == 1.25 and res["decode"]["idle_ms"]["sum"] == 0.0
    assert res["gpu_ms"] == 4.25 and res["idle_ms"] == 0.5
    assert "gpu_ms" not in res["drain"]
    assert rows[1]["prev_gpu_ms"] == 3.0  # the caller's rows are left as they were


def test_after_idle_and_the_mixed_steps_fit():
    # a warm-up step, a long idle gap, then three mixed steps of 2 ms + 1 us per prompt token
    rows = [{"t0": 0.0, "t_end": 1.0, "seqs": 1, "decodes": 0, "tokens": 8}]
    t = 1000.0
    for prompt in (512, 1024, 2048):
        rows.append({"t0": t, "t_end": t + 1, "seqs": 3, "decodes": 2, "tokens": prompt + 2})
        t += 5
    rows.append({"t0": t, "t_end": t + 1})  # drain
    times = [(1.0, 0.0), (2.512, 900.0), (3.024, 0.0), (4.048, 0.0)]
    for row, (gpu, idle) in zip(rows[1:], times):
        row["prev_gpu_ms"], row["prev_idle_ms"] = gpu, idle
    res = trace_summary.summarize(rows, after_idle_ms=100.0)
    assert res["steps"] == 4 and "prefill" not in res  # the warm-up step is dropped
    assert res["idle_ms"] == 0.0  # and so is the wait after it
    fit = res["mixed"]["gpu_fit"]
    assert abs(fit["fixed_ms"] - 2.0) < 1e-9 and abs(fit["us_per_prompt_token"] - 1.0) < 1e-9
    assert trace_summary.summarize(rows)["steps"] == 5  # without --after-idle every row counts


def test_token_gaps_count_each_step_once_per_decode_row():
    rows = [{"t0": 0.0, "seqs": 1, "decodes": 0, "tokens": 30},  # a prefill engine's step
            {"t0": 1.0, "seqs": 3, "decodes": 3, "tokens": 3},
            {"t0": 11.0, "seqs": 1, "decodes": 1, "tokens": 1},
            {"t0": 12.0, "seqs": 2, "decodes": 2, "tokens": 2},
            {"t0": 5.0, "seqs": 1, "decodes": 0, "tokens": 40},  # written later by the other engine
            {"t0": 32.0, "seqs": 2, "decodes": 2, "tokens": 2}]
    got = trace_summary.token_gaps(rows, decoding_engine=True)
    # decode rows 1 -> 11 (3 rows wait 10 ms), 11 -> 12 (1 row, 1 ms), 12 -> 32 (2 rows, 20 ms)
    assert got["rows"] == 6 and got["median_ms"] == 10.0 and got["p99_ms"] == 20.0 and got["p99_over_median"] == 2.0
    # one engine: its prefill step at t 5 ends the wait of the rows of the step at t 1
    assert trace_summary.token_gaps(rows)["rows"] == 6 and trace_summary.token_gaps(rows)["median_ms"] == 4.0
