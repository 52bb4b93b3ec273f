"""Data-parallel replicas (`serve run --data-parallel-size 2`) on the CPU: greedy output equals one
engine's, streamed and whole, also with each replica a tensor-parallel group; requests spread over both replicas; a repeated prompt goes to the
replica holding its prefix; an abort frees the blocks of its replica; a killed replica fails its own
requests while the other serves on, and the server exits non-zero once none is left; placement
errors are one line."""
from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.config import EngineConfig
from serve.engine_set import visible_gpus
from serve.replicas import place_replicas
from tests.serve.helpers import (HOST, SubprocessServer, client_of, metric_samples, page_samples, paused,
                                 serve_run_usage_error, wait_gauges)
from tests.serve.test_embeddings_server import same_embeddings
from tests.serve.test_shutdown import engine_children, start_server

PROMPTS = [[5, 80, 17, 301, 44, 9, 120], [250, 3, 3, 77], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [99, 98]]
MAX_NEW = 12
LONG = 120  # tokens: a stream that outlasts the kill of its replica


@pytest.fixture(scope="module")
def dp(model_dir):
    """`serve run --data-parallel-size 2` as a subprocess, shared by the module; its last test kills
    both replicas."""
    with client_of(*start_server(model_dir, "--data-parallel-size", "2")) as srv:
        yield srv


def body(prompt: list[int], stream: bool, max_tokens: int = MAX_NEW) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def complete(base_url: str, prompt: list[int], stream: bool, max_tokens: int = MAX_NEW) -> str:
    url = f"{base_url}/v1/completions"
    if not stream:
        r = httpx.post(url, json=body(prompt, False, max_tokens), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url, json=body(prompt, True, max_tokens), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def per_replica(srv: SubprocessServer, name: str, **labels: str) -> list[float]:
    """The series `name` of replicas 0 and 1 (0 where it has no sample yet)."""
    return _by_replica(metric_samples(srv.http, name, **labels))


def _by_replica(samples: list) -> list[float]:
    values = [0.0, 0.0]
    for s in samples:
        if s.labels.get("replica") in ("0", "1"):
            values[int(s.labels["replica"])] += s.value
    return values


def finished(srv: SubprocessServer, reason: str = "length") -> list[float]:
    return per_replica(srv, "pagedserve:request_success_total", finished_reason=reason)


def wait_idle(srv: SubprocessServer, timeout: float = 10.0) -> None:
    """Until no replica runs, queues or holds a KV block (their gauges on /metrics)."""
    wait_gauges(lambda name: per_replica(srv, name), [0.0, 0.0], timeout)


def test_embeddings_equal_one_engines(dp, server):
    same_embeddings(dp.url, server.base_url)


def test_greedy_output_equals_one_engines_and_requests_spread(dp, server):
    want = [complete(server.base_url, p, stream=False) for p in PROMPTS]
    before = finished(dp)
    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        got = list(pool.map(lambda a: complete(dp.url, *a), [(p, s) for s in (False, True) for p in PROMPTS]))
    assert got == want + want
    after = finished(dp)
    assert sum(after) - sum(before) == 2 * len(PROMPTS)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both replicas served some
    assert all(t > 0 for t in per_replica(dp, "pagedserve:generation_tokens_total"))
    wait_idle(dp)


def test_replicas_of_tensor_parallel_groups_equal_one_engine(model_dir, server):
    """`--data-parallel-size 2 --tensor-parallel-size 2`: two replicas of two ranks each (four
    engine processes), the layout of several TP groups behind the router."""
    want = [complete(server.base_url, p, stream=False) for p in PROMPTS]
    with client_of(*start_server(model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2")) as srv:
        with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
            got = list(pool.map(lambda a: complete(srv.url, *a), [(p, s) for s in (False, True) for p in PROMPTS]))
        assert got == want + want
        assert all(t > 0 for t in per_replica(srv, "pagedserve:generation_tokens_total"))  # both replicas served
        wait_idle(srv)


def test_a_repeated_prompt_goes_to_the_replica_with_its_prefix(dp):
    prompt = list(range(100, 140))  # two full blocks of 16 and a part
    before, hits_before = finished(dp), per_replica(dp, "pagedserve:prefix_cache_hits_total")
    first = complete(dp.url, prompt, stream=False)
    once = finished(dp)
    (where,) = [i for i in (0, 1) if once[i] > before[i]]
    # by load alone (both idle), the next request would go to the other replica: it has had fewer
    assert complete(dp.url, prompt, stream=True) == first
    twice = finished(dp)
    assert twice[where] == before[where] + 2 and twice[1 - where] == before[1 - where]
    hits = per_replica(dp, "pagedserve:prefix_cache_hits_total")
    assert hits[where] - hits_before[where] >= 32 and hits[1 - where] == hits_before[1 - where]


def test_an_abort_frees_blocks_on_its_replica(dp):
    aborted = finished(dp, "abort")
    engines = engine_children(dp.proc.pid)
    assert len(engines) == 2
    with httpx.Client(base_url=dp.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body(PROMPTS[0], True, max_tokens=400)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            # the replicas held where they are, so that the stream cannot end by its length while
            # the gauges are read (a CPU engine makes its 400 tokens in well under a second); one
            # scrape gives both gauges of one state
            with paused(engines):
                text = dp.http.get("/metrics").text
            running = _by_replica(page_samples(text, "pagedserve:num_requests_running"))
            assert sorted(running) == [0.0, 1.0]
            where = running.index(1.0)
            assert _by_replica(page_samples(text, "pagedserve:kv_cache_used_blocks"))[where] > 0
    wait_idle(dp, timeout=5)
    after = finished(dp, "abort")
    assert after[where] == aborted[where] + 1 and after[1 - where] == aborted[1 - where]


def test_placement():
    cfg = EngineConfig(device="cuda", tensor_parallel_size=2)
    places = place_replicas(cfg, 2, ["0", "1", "2", "3"], cpu_count=16)
    assert [p.gpus for p in places] == [("0", "1"), ("2", "3")] and places[1].cpu_threads is None
    assert [p.gpus for p in place_replicas(EngineConfig(), 2, ["4", "6"], 16)] == [("4",), ("6",)]
    pp = EngineConfig(device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert [p.gpus for p in place_replicas(pp, 2, [str(i) for i in range(8)], 16)] == [("0", "1", "2", "3"),
                                                                                        ("4", "5", "6", "7")]
    with pytest.raises(ValueError, match=r"^--data-parallel-size 2 needs 4 GPUs \(2 per replica\); 3 are visible$"):
        place_replicas(cfg, 2, ["0", "1", "2"], 16)
    # on the CPU the replicas (and their tensor-parallel ranks) share the cores, one left for the server
    assert [p.cpu_threads for p in place_replicas(EngineConfig(device="cpu"), 2, ["0"], 9)] == [4, 4]
    assert place_replicas(EngineConfig(), 3, [], 2)[2].cpu_threads == 1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


@pytest.mark.parametrize("args, message", [
    (["--data-parallel-size", "2", "--device", "cuda"], "--data-parallel-size 2 needs 2 GPUs; 0 are visible"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1; got 0"),
    (["--data-parallel-size", "2", "--engine-loop", "thread"], "--data-parallel-size runs each replica in a process "
                                                               "of its own: drop --engine-loop thread"),
])
def test_bad_flags_are_one_line(model_dir, args, message):
    assert serve_run_usage_error(model_dir, *args) == [f"serve run: error: {message}"]


def stream_tokens(port: int, prompt: list[int], first: threading.Event, out: dict) -> None:
    """Stream a long completion; out gets the number of token chunks, the finish reason and the
    error, if one came."""
    out.update(chunks=0, error=None, finish=None)
    with httpx.stream("POST", f"http://{HOST}:{port}/v1/completions", json=body(prompt, True, LONG), timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out["error"] = data["error"]["message"]
                continue
            out["chunks"] += 1
            out["finish"] = data["choices"][0]["finish_reason"] or out["finish"]
            first.set()
    first.set()


def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(dp, server):
    """Last in the module: it ends the shared server."""
    want = complete(server.base_url, PROMPTS[0], stream=False)
    proc, url = dp.proc, dp.url
    port = int(url.rsplit(":", 1)[1])
    # two long streams, one on each replica (the second finds the first's replica busy)
    firsts, outs = [threading.Event(), threading.Event()], [{}, {}]
    threads = [threading.Thread(target=stream_tokens, args=(port, p, e, o)) for p, e, o in zip(PROMPTS[1:3], firsts, outs)]
    for t, e in zip(threads, firsts):
        t.start()
        assert e.wait(60)
    victim, survivor = engine_children(proc.pid)
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(60)
    failed = [o for o in outs if o["error"] is not None]
    assert len(failed) == 1 and "exited unexpectedly (killed by signal SIGKILL)" in failed[0]["error"]
    assert failed[0]["chunks"] < LONG
    assert [o["finish"] for o in outs if o["error"] is None] == ["length"]
    health = dp.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    dead = [r["replica"] for r in health.json()["replicas"] if r["status"] == "failed"]
    assert len(dead) == 1
    assert per_replica(dp, "pagedserve:replica_up") == [float(i != dead[0]) for i in (0, 1)]
    assert complete(url, PROMPTS[0], stream=True) == want  # the survivor serves
    assert complete(url, PROMPTS[3], stream=False) == complete(server.base_url, PROMPTS[3], stream=False)
    os.kill(survivor, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)  # the server stops on its own
    assert proc.returncode == 1, out
    assert "pagedserve: error: every replica has failed" in out
