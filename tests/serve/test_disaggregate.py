"""Prefill/decode disaggregation (`serve run --disaggregate 1:1`) on the CPU (gloo): greedy output
equals one engine's, streamed and whole, with every prompt's KV moved from the prefill engine to
the decode engine; prefix caching works on the prefill side; an abort frees the blocks of both
engines; a killed decode engine fails its requests and the server exits non-zero; with two prefill
engines, a killed one leaves the other and the decode engine serving (a stream already decoding
finishes); bad flags are one line."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from serve.disagg import parse_disaggregate, place_engines
from tests.serve.helpers import (HOST, SubprocessServer, client_of, metric_samples, page_samples, paused,
                                 serve_run_usage_error, wait_gauges)
from tests.serve.test_data_parallel import PROMPTS, MAX_NEW, body, complete
from tests.serve.test_embeddings_server import same_embeddings
from tests.serve.test_shutdown import engine_children, start_server

LONG = 120  # tokens: a stream that outlasts the kill of its engine


@pytest.fixture(scope="module")
def pd(model_dir):
    """`serve run --disaggregate 1:1` as a subprocess, shared by the module; its last test kills the
    decode engine."""
    with client_of(*start_server(model_dir, "--disaggregate", "1:1")) as srv:
        yield srv


def series(srv: SubprocessServer, name: str, **labels: str) -> float:
    """The sum of the samples of `name` with these labels (0 where there is none yet)."""
    return sum((s.value for s in metric_samples(srv.http, name, **labels)), 0.0)


def per_role(srv: SubprocessServer, name: str, **labels: str) -> tuple[float, float]:
    return series(srv, name, role="prefill", **labels), series(srv, name, role="decode", **labels)


def wait_idle(srv: SubprocessServer, timeout: float = 10.0) -> None:
    """Until neither engine runs, queues or holds a KV block (their gauges on /metrics)."""
    wait_gauges(lambda name: per_role(srv, name), (0.0, 0.0), timeout)


def test_embeddings_equal_one_engines(pd, server):
    same_embeddings(pd.url, server.base_url)


def test_greedy_output_equals_one_engines_and_kv_moves(pd, server):
    want = [complete(server.base_url, p, stream=False) for p in PROMPTS]
    moved = series(pd, "pagedserve:kv_transfers_total")
    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        got = list(pool.map(lambda a: complete(pd.url, *a), [(p, s) for s in (False, True) for p in PROMPTS]))
    assert got == want + want
    assert series(pd, "pagedserve:kv_transfers_total") - moved == 2 * len(PROMPTS)
    assert series(pd, "pagedserve:kv_transfer_bytes_total") > 0
    # on the CPU a receive is timed as it returns: every byte moved is a timed byte
    assert series(pd, "pagedserve:kv_transfer_timed_bytes_total") == series(pd, "pagedserve:kv_transfer_bytes_total")
    assert series(pd, "pagedserve:kv_transfer_seconds_count") >= 2 * len(PROMPTS)
    assert series(pd, "pagedserve:request_success_total", finished_reason="length") >= 2 * len(PROMPTS)
    prefill_gen, decode_gen = per_role(pd, "pagedserve:generation_tokens_total")
    assert prefill_gen >= 2 * len(PROMPTS) and decode_gen >= 2 * len(PROMPTS) * (MAX_NEW - 1)
    assert per_role(pd, "pagedserve:prompt_tokens_total")[1] == 0  # no prompt computed on the decode side
    wait_idle(pd)


def test_first_token_only_and_several_choices(pd, server):
    prompt = PROMPTS[2]
    one = complete(server.base_url, prompt, stream=False, max_tokens=1)
    assert complete(pd.url, prompt, stream=True, max_tokens=1) == one
    r = pd.http.post("/v1/completions", json={**body(prompt, False), "n": 2})
    assert r.status_code == 200, r.text
    want = complete(server.base_url, prompt, stream=False)
    assert [c["text"] for c in r.json()["choices"]] == [want, want]
    wait_idle(pd)


def test_prefix_caching_on_the_prefill_side(pd):
    prompt = list(range(200, 240))  # two full blocks of 16 and a part
    hits = per_role(pd, "pagedserve:prefix_cache_hits_total")[0]
    first = complete(pd.url, prompt, stream=False)
    assert complete(pd.url, prompt, stream=True) == first
    assert per_role(pd, "pagedserve:prefix_cache_hits_total")[0] - hits >= 32
    wait_idle(pd)


def test_an_abort_frees_blocks_on_both_sides(pd):
    aborted = series(pd, "pagedserve:request_success_total", finished_reason="abort")
    engines = engine_children(pd.proc.pid)
    assert len(engines) == 2
    with httpx.Client(base_url=pd.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body(PROMPTS[0], True, max_tokens=400)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                while not next(lines).startswith("data:"):
                    pass
            # both engines held while one scrape reads their gauges: the stream cannot end by its
            # length in between (tests/serve/test_data_parallel.py)
            with paused(engines):
                text = pd.http.get("/metrics").text

            def role(name: str) -> tuple[float, float]:
                return tuple(sum(s.value for s in page_samples(text, name, role=r)) for r in ("prefill", "decode"))
            assert role("pagedserve:num_requests_running") == (0.0, 1.0)  # decoding on the decode side
            assert role("pagedserve:kv_cache_used_blocks")[1] > 0
    wait_idle(pd, timeout=5)
    assert series(pd, "pagedserve:request_success_total", finished_reason="abort") == aborted + 1


def test_parse_and_placement():
    assert parse_disaggregate("1:1") == (1, 1) and parse_disaggregate("2:3") == (2, 3)
    places = place_engines(EngineConfig(device="cuda"), 1, 2, ["4", "5", "6", "7"], 16)
    assert [(p.role, p.index, p.rank, p.gpus) for p in places] == [
        ("prefill", 0, 0, ("4", "5", "6")), ("decode", 0, 1, ("5", "4", "6")), ("decode", 1, 2, ("6", "4", "5"))]
    assert [p.cpu_threads for p in place_engines(EngineConfig(device="cpu"), 1, 1, [], 9)] == [4, 4]


@pytest.mark.parametrize("args, message", [
    (["--disaggregate", "2"], "--disaggregate takes PREFILL:DECODE engine counts, e.g. 1:1; got '2'"),
    (["--disaggregate", "0:1"], "--disaggregate needs at least one prefill and one decode engine; got '0:1'"),
    (["--disaggregate", "1:1", "--device", "cuda"], "--disaggregate 1:1 needs 2 GPUs; 0 are visible"),
    (["--disaggregate", "1:1", "--engine-loop", "thread"],
     "--disaggregate runs each engine in a process of its own: drop --engine-loop thread"),
    (["--disaggregate", "1:1", "--data-parallel-size", "2"],
     "--disaggregate and --data-parallel-size don't combine yet: pick one"),
    (["--disaggregate", "1:1", "-tp", "2"], "--disaggregate runs engines of one GPU each: drop "
                                            "--tensor-parallel-size and --pipeline-parallel-size"),
])
def test_bad_flags_are_one_line(model_dir, args, message):
    assert serve_run_usage_error(model_dir, *args) == [f"serve run: error: {message}"]


def engine_named(server_pid: int, comm: str) -> int:
    (pid,) = [p for p in engine_children(server_pid) if Path(f"/proc/{p}/comm").read_text().strip() == comm]
    return pid


def long_stream(url: str) -> tuple[threading.Thread, dict, threading.Event]:
    """A streamed completion of LONG tokens on a thread: its text, chunks and error so far, and an
    event set from its third chunk (it is decoding) or an error or its end."""
    out: dict = {"text": "", "chunks": 0, "error": None}
    decoding = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body(PROMPTS[1], True, LONG), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    if "error" in data:
                        out["error"] = data["error"]["message"]
                    else:
                        out["text"] += data["choices"][0]["text"]
                        out["chunks"] += 1
                    if out["chunks"] >= 3 or out["error"]:
                        decoding.set()
        decoding.set()

    t = threading.Thread(target=stream)
    t.start()
    return t, out, decoding


def test_a_killed_prefill_engine_leaves_the_other_serving(model_dir, server):
    proc, port = start_server(model_dir, "--disaggregate", "2:1")
    with client_of(proc, port) as srv:
        want = [complete(server.base_url, p, stream=False) for p in PROMPTS]
        long_want = complete(server.base_url, PROMPTS[1], stream=False, max_tokens=LONG)
        t, out, decoding = long_stream(srv.url)
        assert decoding.wait(60)
        os.kill(engine_named(proc.pid, "pagedserve-p0"), signal.SIGKILL)
        for _ in range(300):
            r = srv.http.get("/health")
            if r.json()["status"] == "degraded":
                break
            time.sleep(0.1)
        assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == ["failed", "ok", "ok"]
        t.join(60)
        assert (out["error"], out["text"]) == (None, long_want)  # its KV was on the decode engine already
        assert [complete(srv.url, p, stream=s) for s in (False, True) for p in PROMPTS] == want + want
        assert proc.poll() is None


def test_a_killed_decode_engine_fails_its_requests_and_the_server_exits(pd):
    """Last in the module: it ends the shared server."""
    port = int(pd.url.rsplit(":", 1)[1])
    t, out, first = long_stream(f"http://{HOST}:{port}")
    assert first.wait(60)
    os.kill(engine_named(pd.proc.pid, "pagedserve-d0"), signal.SIGKILL)
    t.join(60)
    assert out["error"] is not None and "exited unexpectedly (killed by signal SIGKILL)" in out["error"]
    assert out["chunks"] < LONG
    output, _ = pd.proc.communicate(timeout=30)  # no decode engine is left: the server stops on its own
    assert pd.proc.returncode == 1, output
    assert "pagedserve: error: every decode engine has failed" in output
