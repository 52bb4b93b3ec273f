"""`serve bench` end to end against a fake server whose timing and token counts are known.

Timing asserts leave room for scheduling jitter: the client timestamps a chunk when it gets to
read it, so a late first chunk shortens the gaps after it; lower bounds are the fake's sleeps less
a few ms, upper bounds are generous.
"""
from __future__ import annotations

import time

import pytest

from bench.workload import arrival_offsets

REQUIRED_KEYS = {
    "gpu", "model", "date", "concurrency", "request_rate", "num_prompts", "input_len", "output_len", "completed",
    "failed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
    "roofline_output_throughput", "roofline_fraction", "goodput",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}
# the fake streams chunks of 1, 2, 1, 2, ... tokens: 9 tokens come in 6 chunks
TTFT, GAP, OUT = 0.05, 0.02, 9


def test_counts_and_latencies(fake_server, bench):
    srv = fake_server(ttft_s=TTFT, chunk_interval_s=GAP, tokens_per_chunk=(1, 2))
    code, res = bench("--url", srv.base_url, "--num-prompts", "8", "--input-len", "12", "--output-len", str(OUT),
                      "--concurrency", "4", "--ignore-eos")
    assert code == 0
    assert REQUIRED_KEYS <= res.keys()
    assert (res["completed"], res["failed"]) == (8, 0)
    assert res["total_output_tokens"] == 8 * OUT and res["total_input_tokens"] == 8 * 12
    assert res["model"] == "fake-model" and res["concurrency"] == 4 and res["request_rate"] is None
    assert 50 <= res["median_ttft_ms"] < 50 + 150
    # per request the ITLs are 10, 10, 20, 10, 10, 20, 10, 10 ms: median 10, mean 13.75
    assert 10 - 3 <= res["median_itl_ms"] < 10 + 25
    assert 13.75 - 3 <= res["mean_itl_ms"] < 13.75 + 25
    assert res["p90_itl_ms"] > 15  # the single-token chunks' 20 ms gaps
    e2e = (TTFT + 5 * GAP) * 1000
    assert e2e <= res["median_e2el_ms"] < e2e + 200
    assert 12.5 - 3 <= res["median_tpot_ms"] < 12.5 + 25  # (e2e - ttft) / 8
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration_s"])
    assert res["roofline_output_throughput"] is None  # no --model: no roofline
    assert 0 < res["client_cpu_fraction"] < 0.8  # the client mostly waits for this slow server
    # what the server was sent
    body = srv.behaviour.seen[-1]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True} and len(body["prompt"]) == 12


def test_chunk_times_on_the_monotonic_clock(fake_server, bench):
    srv = fake_server(ttft_s=TTFT, chunk_interval_s=GAP, tokens_per_chunk=(1, 2))
    before = time.perf_counter()
    code, res = bench("--url", srv.base_url, "--num-prompts", "3", "--input-len", "4", "--output-len", str(OUT),
                      "--concurrency", "3", "--ignore-eos", "--chunk-times")
    after = time.perf_counter()
    assert code == 0
    assert before <= res["clock_start_s"] <= after
    for r in res["requests"]:
        chunks = r["chunk_s"]
        assert len(chunks) == 6 and chunks == sorted(chunks)  # 9 tokens in chunks of 1, 2, 1, 2, ...
        assert chunks[0] == pytest.approx(r["ttft_ms"] / 1e3, abs=1e-6)
        assert res["clock_start_s"] + r["start_s"] + chunks[-1] <= after
    code, plain = bench("--url", srv.base_url, "--num-prompts", "1", "--input-len", "4", "--output-len", "2")
    assert code == 0 and "clock_start_s" not in plain and "chunk_s" not in plain["requests"][0]


def test_concurrency_is_a_cap(fake_server, bench):
    srv = fake_server(ttft_s=0.03, chunk_interval_s=0.01)
    code, res = bench("--url", srv.base_url, "--num-prompts", "6", "--input-len", "4", "--output-len", "3",
                      "--concurrency", "2")
    assert code == 0
    spans = [(r["start_s"], r["start_s"] + r["e2el_ms"] / 1000) for r in res["requests"]]
    for start, _ in spans:
        in_flight = sum(1 for s, e in spans if s <= start < e)
        assert in_flight <= 2


def test_failures_are_counted(fake_server, bench):
    # the server's request 0 is the test request; 3, 6 and 9 fail
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005, fail_every=3)
    code, res = bench("--url", srv.base_url, "--num-prompts", "9", "--input-len", "4", "--output-len", "3",
                      "--concurrency", "3")
    assert code == 0
    assert (res["completed"], res["failed"]) == (6, 3)
    assert res["total_output_tokens"] == 6 * 3
    assert list(res["errors"]) == ["HTTP 500: {\"error\":{\"message\":\"injected failure\"}}"]
    assert sum(r["error"] is not None for r in res["requests"]) == 3


def test_goodput(fake_server, bench):
    srv = fake_server(ttft_s=0.03, chunk_interval_s=0.01)
    args = ("--url", srv.base_url, "--num-prompts", "4", "--input-len", "4", "--output-len", "3")
    code, res = bench(*args, "--goodput", "ttft:5000", "tpot:5000")
    assert code == 0 and res["goodput"] == pytest.approx(res["request_throughput"])
    assert res["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 5000.0}
    code, res = bench(*args, "--goodput", "ttft:10")  # the fake waits 30 ms before the first token
    assert code == 0 and res["goodput"] == 0.0
    code, res = bench(*args)
    assert res["goodput"] is None


def test_poisson_arrivals_follow_the_seeded_schedule(fake_server, bench):
    srv = fake_server(ttft_s=0.005, chunk_interval_s=0.005)
    code, res = bench("--url", srv.base_url, "--num-prompts", "8", "--input-len", "4", "--output-len", "2",
                      "--request-rate", "40", "--seed", "3")
    assert code == 0 and res["request_rate"] == 40.0
    expected = arrival_offsets(8, 40.0, seed=3)
    starts = [r["start_s"] for r in res["requests"]]
    # never before its arrival time (a loaded machine may only make one late: no upper bound)
    assert all(want - 0.002 <= got for got, want in zip(starts, expected))
    assert len(starts) == 8


def test_roofline_and_plot(fake_server, bench, tmp_path):
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005, model_name="qwen")
    png = tmp_path / "bench.png"
    code, res = bench("--url", srv.base_url, "--model", "qwen2.5-0.5b", "--served-model-name", "qwen",
                      "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--concurrency", "4",
                      "--copy-bandwidth", "3.01", "--matmul-tflops", "810", "--plot", str(png))
    assert code == 0
    assert res["roofline_output_throughput"] > 0
    assert res["roofline_fraction"] == pytest.approx(res["output_throughput"] / res["roofline_output_throughput"])
    assert res["roofline_decode_step_ms"] > 0 and res["copy_bandwidth_tbs"] == 3.01
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # token ids come from the model's vocabulary
    assert all(0 <= t < 151936 for body in srv.behaviour.seen for t in body["prompt"])


def test_wrong_model_name_fails_fast(fake_server, bench, capsys):
    srv = fake_server()
    code, res = bench("--url", srv.base_url, "--served-model-name", "nope", "--num-prompts", "2")
    assert code == 1 and res is None
    assert "test request" in capsys.readouterr().err


def test_warmups_and_probe_share_no_tokens_with_the_measured_prompts(fake_server, bench):
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005)
    code, res = bench("--url", srv.base_url, "--num-prompts", "4", "--input-len", "16", "--output-len", "3",
                      "--shared-prefix-len", "8", "--num-warmups", "3", "--concurrency", "2")
    assert code == 0 and res["completed"] == 4
    seen = [b["prompt"] for b in srv.behaviour.seen]
    assert len(seen) == 1 + 3 + 4  # probe, warm-ups, measured
    unmeasured, measured = seen[:4], seen[4:]
    prefix = measured[0][:8]
    assert all(p[:8] == prefix for p in measured)
    assert all(len(p) == 16 and p[:8] != prefix for p in unmeasured)
    assert all(p[:8] == unmeasured[0][:8] for p in unmeasured)  # their own shared prefix


def test_sampling_and_text_prompts(fake_server, bench, tmp_path):
    """--temperature/--top-p/--extra-body reach every request; --prompt-format text sends text that the model
    folder's tokenizer reads as --input-len tokens; the result JSON says which and the chunk gaps."""
    import json

    from tests.models import build_model

    folder = build_model("llama", tmp_path / "tiny")
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005)
    code, res = bench("--url", srv.base_url, "--model", str(folder), "--num-prompts", "4", "--input-len", "24",
                      "--output-len", "4", "--temperature", "0.8", "--top-p", "0.95", "--prompt-format", "text",
                      "--extra-body", '{"repetition_penalty": 1.1, "min_p": 0.05}',
                      "--copy-bandwidth", "3", "--matmul-tflops", "800")
    assert code == 0
    body = srv.behaviour.seen[-1]
    assert body["temperature"] == 0.8 and body["top_p"] == 0.95 and isinstance(body["prompt"], str)
    assert all(b["repetition_penalty"] == 1.1 and b["min_p"] == 0.05 for b in srv.behaviour.seen)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert [len(tok.encode(b["prompt"])) for b in srv.behaviour.seen] == [24] * len(srv.behaviour.seen)
    assert (res["temperature"], res["top_p"], res["prompt_format"]) == (0.8, 0.95, "text")
    assert res["extra_body"] == {"repetition_penalty": 1.1, "min_p": 0.05}
    assert res["p99_chunk_gap_ms"] is not None and res["serial_bound_fraction"] is not None
    assert json.dumps(res)  # serializable


def test_no_roofline_says_why(fake_server, bench, capsys):
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005)
    code, _ = bench("--url", srv.base_url, "--num-prompts", "2", "--input-len", "4", "--output-len", "2")
    assert code == 0
    assert "pass --model" in capsys.readouterr().out


def test_roofline_of_several_gpus_sums_their_rates(fake_server, bench):
    """--num-gpus N: the bound of N GPUs splitting the model, each with the given rates."""
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005, model_name="qwen")
    args = ("--url", srv.base_url, "--model", "qwen2.5-0.5b", "--served-model-name", "qwen", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "4", "--concurrency", "4", "--copy-bandwidth", "3", "--matmul-tflops", "800")
    code, one = bench(*args)
    assert code == 0 and one["roofline_num_gpus"] == 1
    code, two = bench(*args, "--num-gpus", "2")
    assert code == 0 and two["roofline_num_gpus"] == 2 and two["copy_bandwidth_tbs"] == 6
    assert two["roofline_output_throughput"] == pytest.approx(2 * one["roofline_output_throughput"])
    assert two["roofline_decode_step_ms"] == pytest.approx(one["roofline_decode_step_ms"] / 2)


def test_measured_rates_give_both_bounds(fake_server, bench, capsys, monkeypatch, tmp_path):
    """A measured GPU (here a stand-in) gives the bounds at its sustained matmul rate and, beside
    them, the fractions at its cold burst rate."""
    from bench import cli
    from bench.hardware import Measurement
    from tests.models import build_model

    monkeypatch.setattr(cli, "measure_in_subprocess",
                        lambda: Measurement("Stand-in GPU", 3e12, 600e12, matmul_flops_burst=800e12))
    folder = build_model("llama", tmp_path / "tiny")
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005)
    code, res = bench("--url", srv.base_url, "--model", str(folder), "--num-prompts", "4", "--input-len", "24",
                      "--output-len", "4")
    assert code == 0
    assert (res["matmul_tflops"], res["matmul_tflops_burst"]) == (600.0, 800.0)
    assert res["serial_bound_fraction_at_burst_rate"] <= res["serial_bound_fraction"]
    assert res["roofline_fraction_at_burst_rate"] <= res["roofline_fraction"]
    out = capsys.readouterr().out
    assert "Matmul rate, sustained (TFLOP/s):" in out and "Fractions at the burst rate:" in out
