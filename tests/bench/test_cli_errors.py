"""Bad command lines: one line on stderr, exit code 2, no traceback, nothing sent anywhere."""
from __future__ import annotations

import pytest

from bench.cli import main

BAD = [
    [],  # neither --url nor --model
    ["--url", "localhost:8000"],
    ["--url", "http://127.0.0.1:9", "--goodput", "ttft"],
    ["--url", "http://127.0.0.1:9", "--goodput", "latency:5"],
    ["--url", "http://127.0.0.1:9", "--concurrency", "0"],
    ["--url", "http://127.0.0.1:9", "--request-rate", "-1"],
    ["--url", "http://127.0.0.1:9", "--client-processes", "0"],
    ["--url", "http://127.0.0.1:9", "--client-processes", "-2"],
    ["--url", "http://127.0.0.1:9", "--range-ratio", "1.5"],
    ["--url", "http://127.0.0.1:9", "--input-len", "16", "--shared-prefix-len", "17"],
    ["--url", "http://127.0.0.1:9", "--num-prompts", "0"],
    ["--url", "http://127.0.0.1:9", "--num-gpus", "0"],
    ["--url", "http://127.0.0.1:9", "--extra-body", '{"max_tokens": 5}'],
    ["--url", "http://127.0.0.1:9", "--server-args=--enforce-eager"],
    ["--url", "http://127.0.0.1:9", "--copy-bandwidth", "3"],
    ["--url", "http://127.0.0.1:9", "--result-json", "/no/such/folder/r.json"],
    ["--url", "http://127.0.0.1:9", "--chunk-times"],  # nowhere to write them
    ["--url", "http://127.0.0.1:9", "--chunk-times", "--result-json", "r.json", "--request-rate", "2,4"],
    ["--url", "http://127.0.0.1:9", "--model", "no-such-model"],
    ["--url", "http://127.0.0.1:9", "--model", "llama3-8b", "--kv-cache-dtype", "fp4"],
    ["--model", "llama3-8b", "--server-command", "no-such-program-xyz run"],
    ["--model", "llama3-8b", "--server-args", "'unterminated"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) or "nothing" for a in BAD])
def test_bad_input(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("serve bench: error: ")
    assert "Traceback" not in err[0]


def test_bad_number_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--url", "http://127.0.0.1:9", "--concurrency", "abc"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--concurrency" in err[0]


@pytest.mark.parametrize("body", ["[1, 2]", "{not json"])
def test_bad_extra_body_is_one_line_too(capsys, body):
    with pytest.raises(SystemExit) as exit_:
        main(["--url", "http://127.0.0.1:9", "--extra-body", body])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--extra-body" in err[0] and "JSON object" in err[0]


def test_bad_client_processes_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--url", "http://127.0.0.1:9", "--client-processes", "two"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--client-processes" in err[0]


def test_roofline_gpus_come_from_the_started_servers_tensor_parallel_size():
    from bench.cli import roofline_gpus

    assert roofline_gpus(None, []) == 1
    assert roofline_gpus(None, ["--enforce-eager", "--tensor-parallel-size", "4"]) == 4
    assert roofline_gpus(None, ["--tensor-parallel-size=2"]) == 2
    assert roofline_gpus(None, ["-tp", "2", "--pipeline-parallel-size", "2"]) == 4
    assert roofline_gpus(None, ["--pipeline-parallel-size=3"]) == 3
    assert roofline_gpus(None, ["--disaggregate", "1:2"]) == 3
    assert roofline_gpus(3, ["--tensor-parallel-size", "2"]) == 3  # --num-gpus says
