"""`serve run --pipeline-parallel-size 2` (and -tp 2 -pp 2) as a real subprocess on the CPU (gloo):
streamed and whole completions, alone and side by side, equal transformers' greedy output; a size larger than the
model's layers is one line and exit status 2; a stage rank killed mid-stream fails the request with
the reason, and the server exits non-zero instead of hanging."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.models import hf_greedy
from tests.serve.helpers import free_port
from tests.serve.test_shutdown import REPO, start_server
from tests.serve.test_tensor_parallel_server import MAX_NEW, PROMPTS, complete, kill_rank_mid_stream, stop


def test_streamed_and_whole_completions_equal_transformers(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    want = [tok.decode(ids, skip_special_tokens=True) for ids in hf_greedy(model_dir, PROMPTS, MAX_NEW)]
    proc, port = start_server(model_dir, "-pp", "2")
    try:
        assert complete(port, PROMPTS[0], stream=False) == want[0]
        assert complete(port, PROMPTS[1], stream=True) == want[1]
        with ThreadPoolExecutor(4) as pool:  # side by side: micro-batches of both
            got = list(pool.map(lambda a: complete(port, *a), [(PROMPTS[0], True), (PROMPTS[1], False),
                                                               (PROMPTS[1], True), (PROMPTS[0], False)]))
        assert got == [want[0], want[1], want[1], want[0]]
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_tp2_x_pp2_completions_equal_transformers(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    want = [tok.decode(ids, skip_special_tokens=True) for ids in hf_greedy(model_dir, PROMPTS, MAX_NEW)]
    proc, port = start_server(model_dir, "-tp", "2", "-pp", "2")
    try:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda a: complete(port, *a), [(PROMPTS[0], True), (PROMPTS[1], False)]))
        assert got == want
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_a_size_larger_than_the_layers_is_one_line(model_dir):
    cmd = [sys.executable, "-m", "serve.cli", "run", "--model", str(model_dir), "--device", "cpu",
           "--pipeline-parallel-size", "3", "--port", str(free_port())]
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("serve run: error: pipeline_parallel_size 3 is more than the model's "
                                                 "2 layers; use at most 2 stages")


def test_a_stage_rank_killed_mid_stream_fails_the_request_and_the_server_exits(model_dir):
    error, code, out = kill_rank_mid_stream(model_dir, "--pipeline-parallel-size", "2")
    assert error is not None and "pipeline-parallel rank 1 (stage 1) exited (killed by signal SIGKILL)" in error
    assert code == 1, out
    assert ("pagedserve: error: the engine stopped: pipeline-parallel rank 1 (stage 1) exited (killed by signal "
            "SIGKILL)") in out


def test_under_torchrun_every_rank_exits_cleanly(model_dir):
    """`torchrun --nproc-per-node 2 -m serve.cli generate -pp 2`: the launcher starts both stages,
    rank 0 generates what one engine generates, and both ranks exit 0 once it is done."""
    from serve import LLM, SamplingParams

    want = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64).generate(
        ["Hello world"], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "serve.cli", "generate",
           "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "-pp", "2", "--num-kv-blocks", "64",
           "--max-tokens", "8", "--temperature", "0", "Hello world"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == want
