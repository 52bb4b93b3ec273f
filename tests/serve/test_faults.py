"""Engine faults: an exception in a model step fails that step's requests with a clear error (no
traceback, no path); the fault is logged and counted, and the server goes on serving."""
from __future__ import annotations

import logging
import threading
import time

import openai
import pytest

from tests.serve.helpers import ServerThread, build
from tests.serve.test_errors import TRACE_HINTS


class FaultyExecutor:
    """Wraps the model runner; raises in the next `fail_next` execute() calls; each call takes at
    least `step_s` seconds (a request that must outlast a test's other requests)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.fail_next = 0
        self.step_s = 0.0
        self.lock = threading.Lock()

    def execute(self, batch):
        with self.lock:
            fail, self.fail_next = self.fail_next > 0, max(0, self.fail_next - 1)
        if fail:
            raise RuntimeError("injected fault in /secret/path/model.py line 42")
        if self.step_s:
            time.sleep(self.step_s)
        return self.inner.execute(batch)


@pytest.fixture(scope="module")
def srv(model_dir):
    with ServerThread(build(model_dir)) as s:
        s.faulty = s.call(lambda core: FaultyExecutor(core.executor))
        s.call(lambda core: setattr(core, "executor", s.faulty))
        yield s


def failures(srv) -> float:
    return srv.metrics()["pagedserve:engine_step_failures_total"]


def test_model_fault_fails_the_request_and_the_server_goes_on(srv, caplog):
    before = failures(srv)
    srv.faulty.fail_next = 1
    with caplog.at_level(logging.ERROR, logger="pagedserve"):
        r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    assert r.status_code == 500
    err = r.json()["error"]
    assert "internal error during generation" in err["message"] and not TRACE_HINTS.search(err["message"])
    assert "injected fault" not in r.text
    assert any("model step failed" in rec.getMessage() for rec in caplog.records)  # the server log has it
    assert failures(srv) == before + 1
    r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    srv.wait_idle()


def test_fault_mid_stream_reaches_the_streaming_client(srv):
    c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
    stream = c.completions.create(model=srv.state.model_name, prompt="hello", max_tokens=50, stream=True,
                                  extra_body={"ignore_eos": True})
    texts = []
    with pytest.raises(openai.APIError, match="internal error during generation"):
        for i, chunk in enumerate(stream):
            texts.append(chunk.choices[0].text)
            if i == 2:
                srv.faulty.fail_next = 1
    assert 3 <= len(texts) < 50
    srv.wait_idle()
    ok = c.completions.create(model=srv.state.model_name, prompt="hello", max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_fault_outside_the_model_fails_in_flight_requests_only(srv):
    """A step that raises in the scheduler (a bug): every in-flight request fails cleanly, the
    allocator is left consistent, and the next requests are served."""
    before = failures(srv)
    core_step = srv.state.loop.core.step
    calls = {"n": 0}

    def broken_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise AssertionError("scheduler invariant broken")
        return core_step()

    srv.state.loop.core.step = broken_step
    try:
        r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 20, "ignore_eos": True})
    finally:
        del srv.state.loop.core.step
    assert r.status_code == 500 and "internal error" in r.json()["error"]["message"]
    assert "invariant" not in r.text
    srv.wait_idle()
    assert srv.state.loop.num_loop_faults == 1
    assert failures(srv) == before + 1  # counted by the core, once
    r = srv.http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200
