"""PAGEDSERVE_STEP_TRACE (scheduler/trace.py) and its summary: one row per engine step, its phases."""
from __future__ import annotations

import json

from bench import trace_summary


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
