"""PAGEDSERVE_STEP_TRACE (scheduler/trace.py) and its summary: one row per engine step, its phases."""
from __future__ import annotations

import gzip
import json

import pytest

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
    # each prompt's tokens attend over 1..20 positions, its three decodes over 21, 22 and 23 (a
    # round of n model steps: each one position further), whichever steps carried them
    attended = sum(r["attended"] * r["steps"] + r["decodes"] * r["steps"] * (r["steps"] - 1) / 2 for r in rows)
    assert attended == 3 * (sum(range(1, 21)) + 21 + 22 + 23)
    # a decode attends over the positions it reads and its own
    assert all(r["attended"] == r["cached"] + r["seqs"] for r in rows if r["decodes"] == r["seqs"])


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


def _cost(tiny_models):
    from bench.roofline import HardwareRates, ModelCost
    from engine.config import ModelConfig

    return ModelCost.of(ModelConfig.from_path(tiny_models["llama"])), HardwareRates(2e12, 1e14)


def test_a_steps_bound_counts_weights_kv_and_flops(tiny_models):
    cost, rates = _cost(tiny_models)
    m, kv = cost.model, cost.kv_bytes_per_token
    flops_per_pos = cost.attention_flops(1)
    # two decodes at 10 and 20 cached positions: 11 + 21 attended, 30 read, 2 written
    row = {"seqs": 2, "decodes": 2, "tokens": 2, "attended": 32.0, "cached": 30}
    want = max((2.0 * m.active_params() * 2 + 32 * flops_per_pos) / rates.matmul_flops,
               (cost.weight_bytes + 32 * kv) / rates.copy_bandwidth) * 1e3
    assert abs(trace_summary.step_bound_ms(row, cost, rates) - want) < 1e-12
    # the same as a round of 3 model steps: each reads the weights, every row one position further
    three = {**row, "steps": 3}
    attended, read = 96 + 2 * (0 + 1 + 2), 90 + 2 * (0 + 1 + 2)
    want3 = max((2.0 * m.active_params() * 6 + attended * flops_per_pos) / rates.matmul_flops,
                (3 * cost.weight_bytes + (read + 6) * kv) / rates.copy_bandwidth) * 1e3
    assert abs(trace_summary.step_bound_ms(three, cost, rates) - want3) < 1e-12
    assert trace_summary.step_bound_ms({"seqs": 2, "decodes": 2, "tokens": 2}, cost, rates) is None  # an old trace


def test_each_kind_of_step_against_its_bound(tiny_models, tmp_path, capsys):
    cost, rates = _cost(tiny_models)
    rows = [{"t0": 0.0, "t_end": 1.0, "seqs": 1, "decodes": 0, "tokens": 64, "attended": 64 * 32.5, "cached": 0},
            {"t0": 1.0, "t_end": 2.0, "seqs": 1, "decodes": 1, "tokens": 1, "attended": 65.0, "cached": 64,
             "prev_gpu_ms": 0.5, "prev_idle_ms": 0.0},
            {"t0": 2.0, "t_end": 2.5, "prev_gpu_ms": 0.25, "prev_idle_ms": 0.0}]
    res = trace_summary.summarize(rows, cost=cost, rates=rates)
    for k, gpu in (("prefill", 0.5), ("decode", 0.25)):
        bound = trace_summary.step_bound_ms(rows[0 if k == "prefill" else 1], cost, rates)
        assert res[k]["bound_ms"]["sum"] == bound and abs(res[k]["gpu_over_bound"] - gpu / bound) < 1e-12
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"copy_bandwidth_tbs": 2.0, "matmul_tflops": 100.0, "kv_cache_dtype": "auto"}))
    assert trace_summary.main([str(path), "--model", str(tiny_models["llama"]), "--bench-json", str(bench)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode"]["gpu_over_bound"] == res["decode"]["gpu_over_bound"]
    # the whole run: its device time against the sum of its steps' bounds
    total = res["prefill"]["bound_ms"]["sum"] + res["decode"]["bound_ms"]["sum"]
    assert res["bound_ms"] == pytest.approx(total) and res["gpu_over_bound"] == pytest.approx(0.75 / total)
    assert "schedule_fraction" not in out  # a result without the physical bound
    # with it: the physical bound's time of the run against the sum of the steps' bounds
    bench.write_text(json.dumps({"copy_bandwidth_tbs": 2.0, "matmul_tflops": 100.0, "kv_cache_dtype": "auto",
                                 "total_output_tokens": 2, "roofline_output_throughput": 4000.0}))
    assert trace_summary.main([str(path), "--model", str(tiny_models["llama"]), "--bench-json", str(bench)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["physical_bound_ms"] == pytest.approx(0.5) and out["schedule_fraction"] == pytest.approx(0.5 / total)
    with pytest.raises(SystemExit):  # a model without rates
        trace_summary.main([str(path), "--model", str(tiny_models["llama"])])


def test_a_preset_name_and_one_line_errors(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"t0": 0.0, "t_end": 1.0, "seqs": 64, "decodes": 64, "tokens": 64,
                                "attended": 64 * 600.0, "cached": 64 * 599}) + "\n"
                    + json.dumps({"t0": 1.0, "t_end": 2.0, "prev_gpu_ms": 7.0, "prev_idle_ms": 0.0}) + "\n")
    rates = ["--copy-bandwidth", "3.0", "--matmul-tflops", "800"]
    assert trace_summary.main([str(path), "--model", "llama3-8b", *rates]) == 0
    bound = json.loads(capsys.readouterr().out)["decode"]["bound_ms"]["sum"]
    assert 5.0 < bound < 8.0  # 16 GB of weights and ~2 GB of KV at 3 TB/s
    packed = tmp_path / "t.jsonl.gz"  # a trace kept gzipped (lab/overlap.sh's KEEP_TRACE) reads the same
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert trace_summary.main([str(packed), "--model", "llama3-8b", *rates]) == 0
    assert json.loads(capsys.readouterr().out)["decode"]["bound_ms"]["sum"] == bound
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\xff\xfe not a trace")
    for argv, says in (([str(tmp_path / "missing.jsonl")], "can't read the trace"),
                       ([str(path), "--model", "no-such-model", *rates], "neither a folder"),
                       ([str(path), "--model", "llama3-8b", "--bench-json", str(tmp_path / "none.json")],
                        "can't read serve bench's result"),
                       ([str(garbage)], "is not a step trace")):
        with pytest.raises(SystemExit) as e:
            trace_summary.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
