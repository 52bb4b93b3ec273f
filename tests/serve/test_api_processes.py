"""`serve run --api-processes 2` on the CPU: two API processes on one port over one engine process.
Both serve (the load spreads), greedy output equals one process's, /metrics sums both, an abort in
either frees its blocks, a killed API process stops the server with exit 1 and leaves no process
behind; bad flags are one line; the default's choice. SIGTERM and Ctrl-C: test_shutdown.py,
test_ctrl_c.py."""
from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from serve.api_processes import check_api_processes, per_process, settle
from serve.server_config import ServerConfig
from tests.serve.helpers import client_of, metric_samples, serve_run_usage_error, wait_gauges
from tests.serve.test_data_parallel import PROMPTS, complete
from tests.serve.test_shutdown import child_pids, is_running, start_server


def summed(srv, name: str, **labels: str) -> float:
    return sum(s.value for s in metric_samples(srv.http, name, **labels))


def by_process(srv) -> dict[str, float]:
    return {s.labels["api_process"]: s.value
            for s in metric_samples(srv.http, "pagedserve:api_process_http_requests_total")}


@pytest.fixture(scope="module")
def two(model_dir):
    """The server, once both API processes have answered (the second starts after the engine)."""
    with client_of(*start_server(model_dir, "--api-processes", "2", "--shutdown-timeout", "0.5")) as srv:
        deadline = time.monotonic() + 90
        with ThreadPoolExecutor(8) as pool:
            while set(by_process(srv)) != {"0", "1"}:
                assert srv.proc.poll() is None, srv.proc.stdout.read()
                assert time.monotonic() < deadline, f"one API process never served: {by_process(srv)}"
                # several connections at once: each new one goes to whichever process accepts first
                list(pool.map(lambda _: httpx.get(f"{srv.url}/v1/models", timeout=30), range(8)))
        yield srv


def test_greedy_output_equals_one_process_and_metrics_sum_both(two, server):
    before = summed(two, "pagedserve:request_success_total", finished_reason="length")
    served_before = by_process(two)
    want = [complete(server.base_url, p, stream=s) for p in PROMPTS for s in (False, True)]
    with ThreadPoolExecutor(8) as pool:  # at once, so that both processes take some
        got = list(pool.map(lambda ps: complete(two.url, *ps), [(p, s) for p in PROMPTS for s in (False, True)]))
    assert got == want
    # every request counted once, whichever process served it
    assert summed(two, "pagedserve:request_success_total", finished_reason="length") == before + len(want)
    served = by_process(two)
    assert sum(served.values()) >= sum(served_before.values()) + len(want)
    wait_gauges(lambda name: summed(two, name), 0.0, 10)


def test_a_stored_response_is_found_by_either_process(two):
    """Stored responses live in a folder both processes share: GET and previous_response_id find one
    whichever process answers. Rounds of fresh connections until each process has served some."""
    first = httpx.post(f"{two.url}/v1/responses", json={"input": "Hello", "max_output_tokens": 4, "temperature": 0},
                       timeout=60).json()
    url = f"{two.url}/v1/responses/{first['id']}"
    follow = {"input": "More", "previous_response_id": first["id"], "max_output_tokens": 2, "temperature": 0}
    before = by_process(two)
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(8) as pool:
        for rounds in itertools.count(1):
            got = list(pool.map(lambda i: httpx.get(url, timeout=30) if i % 2 else
                                httpx.post(f"{two.url}/v1/responses", json=follow, timeout=60), range(8)))
            assert [g.status_code for g in got] == [200] * 8, [g.text for g in got if g.status_code != 200]
            assert {g.json()["id"] for g in got[1::2]} == {first["id"]}
            served = by_process(two)
            # the metrics requests count too: one a round, this one's after it answers
            if all(served.get(p, 0) - before.get(p, 0) > rounds for p in ("0", "1")):
                break
            assert time.monotonic() < deadline, f"one process served none of them: {before} -> {served}"


def test_aborts_in_either_process_free_their_blocks(two):
    """Streams cut by their clients on both processes: the engine aborts each through the channel
    of the process that added it, and every block comes back."""
    def cut(prompt: list[int]) -> None:
        with httpx.stream("POST", f"{two.url}/v1/completions",
                          json={"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return  # the first token came: hang up

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(cut, PROMPTS * 2))
    wait_gauges(lambda name: summed(two, name), 0.0, 20)
    assert summed(two, "pagedserve:request_success_total", finished_reason="abort") >= len(PROMPTS) * 2


def long_stream(port: int, first: threading.Event, out: list) -> None:
    """A long streamed completion; out gets its finish reasons, or "cut" if the connection broke."""
    body = {"prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    reasons = []
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first.set()
                    reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
        out.append(reasons or "cut")
    except httpx.HTTPError:
        out.append("cut")
    first.set()


def test_a_killed_api_process_stops_the_server(two):
    """Last in the module: it ends the shared server, which exits 1 with the cause, leaving nothing."""
    proc = two.proc
    port = int(two.url.rsplit(":", 1)[1])
    children = child_pids(proc.pid)
    api = [p for p in children if _is_api(p)]
    assert len(api) == 1, children  # the second API process (the engine process holds no socket)
    firsts, outs = [threading.Event() for _ in range(4)], []
    threads = [threading.Thread(target=long_stream, args=(port, e, outs)) for e in firsts]
    for t, e in zip(threads, firsts):
        t.start()
        assert e.wait(60)
    os.kill(api[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    for t in threads:
        t.join(30)
    assert proc.returncode == 1, out
    assert "pagedserve: error: API process pagedserve-api-1 exited unexpectedly (killed by signal SIGKILL)" in out, out
    # the killed process's streams break; the other's end as it drains (or finish within the drain)
    assert len(outs) == 4 and all(o in ("cut", ["abort"], ["length"]) for o in outs), outs
    deadline = time.monotonic() + 10
    while any(is_running(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_running(p) for p in children), "orphaned child processes"
    assert "Traceback" not in out, out


def _is_api(pid: int) -> bool:
    """Whether pid (a spawned child of the server) is an API process: it holds a listening TCP socket."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    with open("/proc/net/tcp") as f:
        listening = {f"socket:[{line.split()[9]}]" for line in f.readlines()[1:] if line.split()[3] == "0A"}
    return bool(inodes & listening)


@pytest.mark.parametrize("args, message", [
    (["--api-processes", "0"], "--api-processes must be >= 1; got 0"),
    (["--api-processes", "2", "--engine-loop", "thread"],
     "--api-processes shares an engine process between API processes: drop --engine-loop thread"),
    (["--api-processes", "2", "--data-parallel-size", "2"],
     "--api-processes works with one engine process: drop --data-parallel-size / --disaggregate"),
])
def test_bad_flags_are_one_line(model_dir, args, message):
    assert serve_run_usage_error(model_dir, *args) == [f"serve run: error: {message}"]


def test_each_process_takes_its_share_of_the_rate_limit():
    assert per_process(ServerConfig(max_request_rate=10.0), 2).max_request_rate == 5.0
    assert per_process(ServerConfig(), 2).max_request_rate is None
    assert check_api_processes(1, "thread", 2, True) == 1  # one API process: anything goes


@pytest.mark.parametrize("cpus, loop, dp, steps, provisioned, serving", [
    (16, "process", 1, 4, 2, 2),  # a host-bound model on a large host: two
    (16, "process", 1, 1, 2, 1),  # a GPU-bound one: the provisioned channel goes unused
    (4, "process", 1, 4, 1, 1),  # too few cores
    (16, "thread", 1, 4, 1, 1),  # no engine process to share
    (16, "process", 2, 4, 1, 1),  # replicas
])
def test_auto_api_processes(monkeypatch, cpus, loop, dp, steps, provisioned, serving):
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert check_api_processes(None, loop, dp, False) == provisioned
    closed = []

    class Conn:
        def close(self):
            closed.append(self)

    engine = SimpleNamespace(runner=SimpleNamespace(num_scheduler_steps=steps), seq_ids=iter(()), api_process=0,
                             core=SimpleNamespace(channels=[(Conn(), Conn())] * (provisioned - 1)))
    assert settle(None, provisioned, engine) == serving
    assert len(closed) == (2 if provisioned > serving else 0)
    assert (engine.api_process is None) == (provisioned > serving)
    assert settle(3, 3, engine) == 3  # asked for: as asked
