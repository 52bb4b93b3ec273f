"""Starting our own server (--model): against a fake `serve run` in a subprocess."""
from __future__ import annotations

import sys
from pathlib import Path

FAKE = f"{sys.executable} {Path(__file__).with_name('fake_server.py')}"


def test_starts_benches_and_stops_the_server(bench, capsys):
    code, res = bench("--model", "qwen2.5-0.5b", "--load-format", "dummy", "--server-command", FAKE,
                      "--server-args=--ttft 0.01", "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
                      "--concurrency", "2", "--copy-bandwidth", "3.01", "--matmul-tflops", "810")
    assert code == 0
    assert (res["completed"], res["failed"]) == (4, 0)
    assert res["server_args"] == "--ttft 0.01"
    assert res["served_model_name"].endswith("Qwen2.5-0.5B")  # the fake serves under its --model path (the preset folder)
    assert res["roofline_output_throughput"] > 0
    err = capsys.readouterr().err
    assert "--load-format dummy" in err and "--port" in err


def test_server_that_dies_is_reported(bench, capsys):
    code, res = bench("--model", "qwen2.5-0.5b", "--server-command", FAKE, "--server-args=--exit-at-once",
                      "--num-prompts", "2", "--copy-bandwidth", "3", "--matmul-tflops", "800")
    assert code == 1 and res is None
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "exited with code 3" in err and "refusing to start" in err
