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
    assert res["engine_cost_model"] is None  # the fake logs none
    err = capsys.readouterr().err
    assert "--load-format dummy" in err and "--port" in err


def test_server_that_dies_is_reported(bench, capsys):
    code, res = bench("--model", "qwen2.5-0.5b", "--server-command", FAKE, "--server-args=--exit-at-once",
                      "--num-prompts", "2", "--copy-bandwidth", "3", "--matmul-tflops", "800")
    assert code == 1 and res is None
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "exited with code 3" in err and "refusing to start" in err


def test_the_engines_cost_model_is_read_from_its_log(tmp_path, caplog):
    """The line engine/runner.py logs at start-up, measured or from its cache, as the result JSON's
    engine_cost_model; a log without it (a CPU engine, another server) gives None."""
    import logging
    from types import SimpleNamespace

    from bench.server import ManagedServer
    from engine.cost_model import StepCostModel
    from engine.runner import ModelRunner

    model = StepCostModel((16, 64, 512), (5.0, 5.5, 11.25), 1e-5, 8192)
    runner = SimpleNamespace(cfg=SimpleNamespace(max_num_seqs=64))
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        ModelRunner._log_step_costs(runner, model, 3.0e12)
        ModelRunner._log_step_costs(runner, model, 3.0e12, " (measured before: /cache/a:b)")
    server = ManagedServer(command=["serve"], model="m", log_path=tmp_path / "server.log")
    for record in caplog.records[-2:]:
        server.log_path.write_text(f"12:00:00 INFO engine ready\n12:00:01 INFO {record.getMessage()}\n")
        assert server.step_cost_model() == {"rows": [16, 64, 512], "forward_ms": [5.0, 5.5, 11.25]}
    server.log_path.write_text("12:00:00 INFO engine ready\n")
    assert server.step_cost_model() is None
