"""`serve run --tensor-parallel-size 2` as a real subprocess on the CPU (gloo): streamed and whole
completions equal transformers' greedy output, and structured output follows its grammar; a size
that does not split the model is one line and exit status 2; a rank killed mid-stream fails the request with the reason, and the server
exits non-zero instead of hanging."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.models import hf_greedy
from tests.serve.helpers import free_port
from tests.serve.test_shutdown import REPO, engine_children, start_server

PROMPTS = [[5, 80, 17, 301, 44, 9, 120], [250, 3, 3, 77]]
MAX_NEW = 12


def complete(port: int, prompt: list[int], stream: bool, max_tokens: int = MAX_NEW, model: str | None = None) -> str:
    """The text of a greedy completion (model: the "model" field, e.g. a LoRA adapter's name)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if model is not None:
        body["model"] = model
    url = f"http://127.0.0.1:{port}/v1/completions"
    if not stream:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


def test_streamed_and_whole_completions_equal_transformers(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    want = [tok.decode(ids, skip_special_tokens=True) for ids in hf_greedy(model_dir, PROMPTS, MAX_NEW)]
    proc, port = start_server(model_dir, "--tensor-parallel-size", "2")
    try:
        assert complete(port, PROMPTS[0], stream=False) == want[0]
        assert complete(port, PROMPTS[1], stream=True) == want[1]
        assert complete(port, PROMPTS[1], stream=False) == want[1]
        check_constrained(port)
    finally:
        code, out = stop(proc)
    assert code == 0, out


def check_constrained(port: int) -> None:
    """Structured output across the ranks (each fills its own masks), whole and streamed."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}
    r = httpx.post(url, timeout=60, json={
        "messages": [{"role": "user", "content": "a city"}], "max_tokens": 60, "temperature": 0.8, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(answer) == {"city", "n"} and isinstance(answer["n"], int)
    body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stream": True,
            "structured_outputs": {"regex": "[a-z]{2,6}( [0-9]{1,3}){2}"}}
    text = ""
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert re.fullmatch("[a-z]{2,6}( [0-9]{1,3}){2}", text), text


def test_a_size_that_does_not_split_the_model_is_one_line(model_dir):
    cmd = [sys.executable, "-m", "serve.cli", "run", "--model", str(model_dir), "--device", "cpu",
           "--tensor-parallel-size", "3", "--port", str(free_port())]
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("serve run: error: tensor_parallel_size 3 must divide the model's 4 "
                                                 "attention heads; sizes that fit this model: 1, 2, 4")


def rank_pids(server_pid: int) -> list[int]:
    """The tensor-parallel ranks: the engine process's children."""
    (engine,) = engine_children(server_pid)
    return engine_children(engine)


def kill_rank_mid_stream(model_dir: Path, *server_args: str) -> tuple[str | None, int, str]:
    """Start a server with server_args, stream a long completion, SIGKILL rank 1 once the first
    chunk arrives. -> (the stream's error message, the server's exit status, its output)."""
    proc, port = start_server(model_dir, *server_args)
    try:
        (rank1,) = rank_pids(proc.pid)
        chunks, error = 0, None
        # 480 tokens take seconds on the CPU; the rank dies after the first one arrives
        body = {"prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]["message"]
                    continue
                chunks += 1
                if chunks == 1:
                    os.kill(rank1, signal.SIGKILL)
        assert chunks < 480
        out, _ = proc.communicate(timeout=30)  # the server stops on its own
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return error, proc.returncode, out


def test_a_rank_killed_mid_stream_fails_the_request_and_the_server_exits(model_dir):
    error, code, out = kill_rank_mid_stream(model_dir, "--tensor-parallel-size", "2")
    assert error is not None and "tensor-parallel rank 1 exited (killed by signal SIGKILL)" in error
    assert code == 1, out
    assert "pagedserve: error: the engine stopped: tensor-parallel rank 1 exited (killed by signal SIGKILL)" in out
