"""`--engine-loop process`: what differs from the thread loop. Admission and abort across the pipe,
faults inside the engine process, call() across the pipe, a failed build, and the engine process
dying under a running server. (test_api and test_disconnect run against both loops.)"""
from __future__ import annotations

import functools
import itertools
import json
import operator
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from bench import trace_summary
from scheduler.engine_proc import EngineStartError
from serve.server_config import ServerConfig
from tests.serve.helpers import ServerThread, build_process, record_schedules, recorded_schedules
from tests.serve.test_errors import TRACE_HINTS
from tests.serve.test_faults import FaultyExecutor

LONG = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


# fn(core) for call(): they run in the engine process, so they are module-level (picklable)
def install_faulty_executor(core) -> None:
    core.executor = FaultyExecutor(core.executor)


def fail_next_steps(n: int, core) -> None:
    core.executor.fail_next = n


def slow_steps(seconds: float, core) -> None:
    core.executor.step_s = seconds


def break_next_step(core) -> None:
    """The next step raises outside the model (a scheduler bug), once."""
    def broken():
        del core.step
        raise AssertionError("scheduler invariant broken")
    core.step = broken


class SlowExecutor:
    """Wraps the model runner; each step takes at least `delay` seconds."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def execute(self, batch):
        time.sleep(self.delay)
        return self.inner.execute(batch)


def install_slow_executor(delay: float, core) -> None:
    core.executor = SlowExecutor(core.executor, delay)


def return_a_lock(core) -> threading.Lock:
    return threading.Lock()


def raise_value_error(core) -> None:
    raise ValueError("asked to fail")


@pytest.fixture(scope="module")
def srv(model_dir):
    """One sequence runs at a time and two may wait; the KV cache holds 256 tokens."""
    with ServerThread(build_process(model_dir, max_num_seqs=1, num_kv_blocks=16),
                      ServerConfig(max_waiting_requests=2, shutdown_timeout_s=1.0)) as s:
        s.call(install_faulty_executor)
        yield s


def metric(srv, name: str) -> float:
    return srv.metrics().get(name, 0.0)


def test_queue_full_rejections_and_aborts_across_the_pipe(srv):
    aborted = metric(srv, "pagedserve:request_success_total{finished_reason=abort}")
    r = srv.http.post("/v1/completions", json={**LONG, "prompt": [5] * 100})  # the core's RequestRejected
    assert r.status_code == 400 and "the whole cache holds 16 blocks" in r.json()["error"]["message"]
    # the first request's 200 steps take 10 s, so it runs while the others arrive however slow the
    # machine (a tiny model's steps took less than two requests' round trips on a loaded CI runner)
    srv.call(functools.partial(slow_steps, 0.05))
    try:
        queue_behind_a_running_request(srv)
    finally:
        srv.call(functools.partial(slow_steps, 0.0))
    srv.wait_idle(timeout=5)  # the three dropped clients were aborted and their blocks freed
    assert metric(srv, "pagedserve:request_success_total{finished_reason=abort}") == aborted + 3
    assert metric(srv, "pagedserve:requests_rejected_total{reason=queue_full}") == 1
    m = srv.metrics()
    assert m["pagedserve:kv_cache_used_blocks"] == 0 and m["pagedserve:num_requests_waiting"] == 0


def queue_behind_a_running_request(srv) -> None:
    """One request runs, two wait (the most that may), a fourth is told to come back later."""
    with srv.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as first:
        lines = first.iter_lines()
        while not next(lines).startswith("data:"):
            pass  # running now; the next two wait
        with srv.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as second, \
                srv.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as third:
            assert (second.status_code, third.status_code) == (200, 200)
            assert srv.state.loop.num_waiting == 2
            r = srv.http.post("/v1/completions", json=LONG)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1


def test_model_fault_in_the_engine_process(srv):
    before = metric(srv, "pagedserve:engine_step_failures_total")
    srv.call(functools.partial(fail_next_steps, 1))
    r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    assert r.status_code == 500
    err = r.json()["error"]["message"]
    assert "internal error during generation" in err and not TRACE_HINTS.search(err) and "injected" not in err
    assert metric(srv, "pagedserve:engine_step_failures_total") == before + 1
    r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    srv.wait_idle()


def test_fault_outside_the_model_in_the_engine_process(srv):
    before = metric(srv, "pagedserve:engine_step_failures_total")
    srv.call(break_next_step)
    r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 20, "ignore_eos": True})
    assert r.status_code == 500 and "internal error" in r.json()["error"]["message"]
    assert "invariant" not in r.text
    srv.wait_idle()
    assert srv.state.loop.num_loop_faults == 1
    # counted once, in the engine process's snapshot: every API process reads the same count
    assert metric(srv, "pagedserve:engine_step_failures_total") == before + 1
    assert srv.state.loop.snapshot.num_step_failures == before + 1
    r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200


def test_call_across_the_pipe(srv):
    with pytest.raises(ValueError, match="asked to fail"):
        srv.call(raise_value_error)
    with pytest.raises(TypeError, match="cannot be sent to the server process"):
        srv.call(return_a_lock)
    with pytest.raises(Exception, match="pickle"):
        srv.call(lambda core: 1)  # a lambda cannot travel to the engine process
    assert srv.call(operator.attrgetter("max_model_len")) == srv.engine.max_model_len


def test_a_failed_build_is_one_clear_line(model_dir, tmp_path):
    with pytest.raises(ValueError, match="not found"):  # checked here, before any process starts
        build_process(tmp_path / "missing")
    with pytest.raises(EngineStartError, match="exceeds the model's context length") as e:
        build_process(model_dir, max_model_len=10**6)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_the_engine_process_dying_fails_requests_and_health(model_dir):
    with ServerThread(build_process(model_dir)) as srv:
        # 200 tokens take >= 4 s: both requests are still running when the engine is killed (the
        # tiny model on the CPU once finished one before the other arrived, and the test hung)
        srv.call(functools.partial(install_slow_executor, 0.02))
        whole: list = []
        waiter = threading.Thread(target=lambda: whole.append(srv.http.post("/v1/completions", json=LONG)))
        waiter.start()
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=30)
        stream = c.completions.create(model=srv.state.model_name, prompt="Hello", max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="engine process exited unexpectedly"):
            for i, _ in enumerate(stream):
                if i == 2:
                    deadline = time.monotonic() + 30
                    while srv.state.loop.num_in_flight < 2:
                        assert time.monotonic() < deadline, f"{srv.state.loop.num_in_flight} requests in flight, not 2"
                        time.sleep(0.01)
                    os.kill(srv.engine.core.pid, signal.SIGKILL)
        waiter.join(timeout=30)
        r = whole[0]
        assert r.status_code == 500 and "killed by signal SIGKILL" in r.json()["error"]["message"]
        assert not TRACE_HINTS.search(r.text)
        health = srv.http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
        m = srv.metrics()
        assert m["pagedserve:request_success_total{finished_reason=error}"] == 2
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 10  # the server stops without hanging on the dead engine


def test_prefill_hold_across_the_pipe(model_dir):
    """--prefill-hold-ms in the engine process: a burst on an idle engine starts as one prefill,
    and the process sleeps until more come or the hold ends instead of stepping in a loop."""
    with ServerThread(build_process(model_dir, prefill_hold_ms=1000.0)) as srv:  # long: a slow CI host must not split the burst
        srv.call(record_schedules)
        bodies = [{"prompt": p, "max_tokens": 4, "temperature": 0} for p in ("Hello", "The capital", "1 2 3", "a b")]
        url = f"{srv.base_url}/v1/completions"
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda body: httpx.post(url, json=body, timeout=30), bodies))
        assert [r.status_code for r in replies] == [200] * 4
        started, empty = srv.call(recorded_schedules)
        assert [len(s) for s in started] == [4] and empty < 50
        srv.wait_idle()


def test_api_and_engine_traces_line_a_request_up_across_the_pipe(model_dir, tmp_path, monkeypatch):
    # PAGEDSERVE_API_TRACE: the API side's step and request rows; the engine process (spawned after
    # the variables are set) writes its steps and the requests it took in to PAGEDSERVE_STEP_TRACE
    api_path, engine_path = tmp_path / "api.jsonl", tmp_path / "engine.jsonl"
    monkeypatch.setenv("PAGEDSERVE_API_TRACE", str(api_path))
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", str(engine_path))
    with ServerThread(build_process(model_dir)) as s:
        for _ in range(2):
            with s.http.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 5, "stream": True}) as r:
                assert r.status_code == 200
                r.read()
    api = [json.loads(x) for x in api_path.read_text().splitlines()]  # the loop flushed it as it stopped
    engine = [json.loads(x) for x in engine_path.read_text().splitlines()]
    requests = [r for r in api if "request" in r]
    assert len(requests) == 2
    for r in requests:  # (added, when the add returned, and first, when the token came in, need no order)
        assert r["received"] <= r["t0"] <= r["added"] and r["t0"] <= r["first"] <= r["t_end"]
    took = {sid: r["t0"] for r in engine if "added" in r for sid in r["added"]}
    assert set(took) == {r["request"] for r in requests}
    for r in requests:  # one clock in both processes: the engine took each request while its add was pending
        assert r["t0"] <= took[r["request"]] <= min(r["added"], r["first"])
    steps = [r for r in api if "outputs" in r]
    assert sum(r["outputs"] for r in steps) >= 2 * 5 and all(r["t0"] <= r["t_end"] for r in steps)
    # the step summary reads past the engine's request rows
    res = trace_summary.summarize(engine)
    assert res["steps"] == len(engine) - len([r for r in engine if "added" in r]) and res["decode"]["steps"] > 0


def test_a_fault_reaches_every_api_process_with_one_count(model_dir):
    """Two API processes' fronts over one engine process (both in this process here, as
    --api-processes runs them): a step that fails outside the model is counted once, in the engine
    process, and both fronts read that count and hear of the fault, the one that held no request too."""
    from serve.engine_process import ProcessEngine, start_engine_process
    from scheduler.engine_proc import ProcessCore
    from tests.serve.helpers import engine_config

    cfg = engine_config(model_dir)
    first = start_engine_process(cfg, show_progress=False, api_processes=2)
    commands, results = first.core.channels.pop()
    second = ProcessEngine(ProcessCore.attach(commands, results, first.core.snapshot), first.tokenizer,
                           first.model_config, cfg, first.runner, itertools.count(1, 2), 1)
    name = "pagedserve:engine_step_failures_total"
    with ServerThread(first) as a, ServerThread(second) as b:
        assert b.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}).status_code == 200
        before = metric(b, name)
        a.call(break_next_step)
        r = a.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 20, "ignore_eos": True})
        assert r.status_code == 500
        a.wait_idle()
        deadline = time.monotonic() + 10
        while metric(b, name) != before + 1:  # the fault's message reaches b's loop on its own
            assert time.monotonic() < deadline, (metric(a, name), metric(b, name), before)
            time.sleep(0.02)
        assert metric(a, name) == before + 1
        assert a.state.loop.num_loop_faults == b.state.loop.num_loop_faults == 1
        assert b.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}).status_code == 200
