"""`serve bench --client-processes N`: the requests sent from several processes against the fake
server. Same requests, same counts as from one process; one concurrency cap and one arrival
schedule over all of them; a failing, killed or interrupted client process ends the run with one
line. No timing asserts beyond wide margins: the processes share this machine's few cores."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.client import CompletionTarget
from bench.load import LoadError, LoadPlan, auto_client_processes, client_process_count, run_load, split_slots
from bench.workload import BenchRequest, WorkloadSpec, arrival_offsets, make_requests

REPO = Path(__file__).resolve().parents[2]


def _workers(parent: int | None = None) -> list[int]:
    """The children of parent (default: this process) that run a multiprocessing worker (not its
    resource tracker)."""
    pids = []
    for children in Path(f"/proc/{parent or os.getpid()}/task").glob("*/children"):
        try:
            pids += [int(p) for p in children.read_text().split()]
        except OSError:  # the thread or the process is gone
            pass
    return [p for p in pids if _is_worker(p)]


# workers that ran before the test: another module's session-scoped server keeps its engine
# process (tests/serve/conftest.py process_server) alive while these tests run
_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _note_other_workers():
    _BEFORE.clear()
    _BEFORE.update(_workers())


def _client_pids() -> list[int]:
    """The client processes: workers started during the test."""
    return [p for p in _workers() if p not in _BEFORE]


def _is_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _target(srv) -> CompletionTarget:
    return CompletionTarget(url=srv.base_url + "/v1/completions", model="fake-model")


def test_auto_client_processes():
    assert auto_client_processes(64, 640, cpus=16) == 2
    assert auto_client_processes(256, 1000, cpus=16) == 4  # at most 4
    assert auto_client_processes(256, 1000, cpus=6) == 3  # at most half the CPUs
    assert auto_client_processes(64, 640, cpus=2) == 1
    assert auto_client_processes(16, 640, cpus=16) == 1  # few streams: today's single process
    assert auto_client_processes(None, 64, cpus=16) == 2  # no cap: every request may be in flight
    assert auto_client_processes(None, 10, cpus=16) == 1


def test_slots_split_evenly_and_never_to_zero():
    assert split_slots(5, 3) == [2, 2, 1] and split_slots(64, 4) == [16] * 4
    assert client_process_count(4, 2, 100) == 2  # 2 in flight at most: 2 processes
    assert client_process_count(4, None, 3) == 3
    assert client_process_count(1, 64, 640) == 1


def _run_cli(bench, srv, processes: int, *extra: str) -> dict:
    code, res = bench("--url", srv.base_url, "--num-prompts", "12", "--input-len", "16", "--output-len", "9",
                      "--range-ratio", "0.5", "--ignore-eos", "--client-processes", str(processes), *extra)
    assert code == 0
    return res


def test_same_requests_and_counts_as_one_process(fake_server, bench):
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005, tokens_per_chunk=(1, 2))
    one = _run_cli(bench, srv, 1, "--concurrency", "4")
    prompts_one = sorted(map(tuple, (b["prompt"] for b in srv.behaviour.seen[1:])))
    del srv.behaviour.seen[:]
    two = _run_cli(bench, srv, 2, "--concurrency", "4")
    assert (one["client_processes"], two["client_processes"]) == (1, 2)
    assert len(two["client_cpu_fractions"]) == 2
    assert two["client_cpu_fraction"] == max(two["client_cpu_fractions"])
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "errors"):
        assert one[key] == two[key], key
    assert two["completed"] == 12
    # request order: request i's lengths are those the workload drew for index i
    spec = WorkloadSpec(num_prompts=12, input_len=16, output_len=9, range_ratio=0.5)
    drawn = [(len(r.prompt), r.output_len) for r in make_requests(spec)]
    for res in (one, two):
        assert [(r["prompt_tokens"], r["output_tokens"]) for r in res["requests"]] == drawn
        assert all(r["error"] is None and r["start_s"] >= 0 for r in res["requests"])
    # the same 12 prompts reached the server (after the probe)
    assert sorted(map(tuple, (b["prompt"] for b in srv.behaviour.seen[1:]))) == prompts_one


def test_one_concurrency_cap_over_all_processes(fake_server, bench):
    srv = fake_server(ttft_s=0.03, chunk_interval_s=0.01)
    code, res = bench("--url", srv.base_url, "--num-prompts", "20", "--input-len", "4", "--output-len", "6",
                      "--concurrency", "5", "--client-processes", "3")
    assert code == 0 and res["completed"] == 20 and res["client_processes"] == 3
    assert srv.behaviour.max_streaming == 5  # slots 2 + 2 + 1, all used, never more
    spans = [(r["start_s"], r["start_s"] + r["e2el_ms"] / 1000) for r in res["requests"]]
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 5


def test_more_processes_than_slots(fake_server, bench):
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005)
    code, res = bench("--url", srv.base_url, "--num-prompts", "6", "--input-len", "4", "--output-len", "3",
                      "--concurrency", "2", "--client-processes", "4")
    assert code == 0 and res["completed"] == 6
    assert res["client_processes"] == 2 and srv.behaviour.max_streaming <= 2


def test_failures_are_counted_across_processes(fake_server, bench):
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.005, fail_every=3)  # the server's 3rd, 6th, 9th
    code, res = bench("--url", srv.base_url, "--num-prompts", "9", "--input-len", "4", "--output-len", "3",
                      "--concurrency", "3", "--client-processes", "2")
    assert code == 0
    assert (res["completed"], res["failed"]) == (6, 3) and res["total_output_tokens"] == 6 * 3


def test_poisson_arrivals_keep_their_offsets(fake_server, bench):
    srv = fake_server(ttft_s=0.005, chunk_interval_s=0.005)
    code, res = bench("--url", srv.base_url, "--num-prompts", "12", "--input-len", "4", "--output-len", "2",
                      "--request-rate", "40", "--seed", "3", "--concurrency", "2", "--client-processes", "2")
    assert code == 0 and res["completed"] == 12 and res["client_processes"] == 2
    expected = arrival_offsets(12, 40.0, seed=3)
    starts = [r["start_s"] for r in res["requests"]]
    assert all(got >= want - 1e-3 for got, want in zip(starts, expected))  # never before its arrival
    assert max(starts) >= expected[-1]
    assert srv.behaviour.max_streaming <= 2


def test_a_finished_slot_takes_the_next_request_in_any_process(fake_server):
    """A shared queue, not a static split: while one process streams a long request, the other
    sends every short one (split in halves, half the short ones would wait for the long one)."""
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.01)
    requests = [BenchRequest(0, [1, 2], 60)] + [BenchRequest(i, [1, 2], 1) for i in range(1, 11)]
    plan = LoadPlan(arrivals=[0.0] * len(requests), concurrency=2, progress=False, processes=2)
    load = asyncio.run(run_load(_target(srv), requests, plan))
    assert [r.index for r in load.results] == list(range(11)) and all(r.success for r in load.results)
    long = load.results[0]
    assert long.output_tokens == 60
    assert max(r.start_s for r in load.results[1:]) < long.start_s + long.e2el_s
    assert load.client_processes == 2 and load.duration_s >= long.e2el_s


def test_an_exception_in_a_client_process_is_one_line(fake_server):
    srv = fake_server()
    requests = [BenchRequest(i, [1, 2], 2) for i in range(3)] + [BenchRequest(3, {1, 2}, 2)]  # a set: no JSON
    plan = LoadPlan(arrivals=[0.0] * 4, concurrency=2, progress=False, processes=2)
    with pytest.raises(LoadError, match=r"^client process \d failed: TypeError: .*JSON") as err:
        asyncio.run(run_load(_target(srv), requests, plan))
    assert "\n" not in str(err.value)
    assert _client_pids() == []


def _kill_a_client_once_streaming(srv, sig: int) -> threading.Thread:
    def kill() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = _client_pids()
            if len(srv.behaviour.seen) > 1 and pids:  # past the probe, the clients are streaming
                os.kill(pids[0], sig)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_a_killed_client_process_ends_the_run_with_one_line(fake_server, bench, capsys):
    srv = fake_server(ttft_s=0.2, chunk_interval_s=0.2)  # ~2 s a request
    killer = _kill_a_client_once_streaming(srv, signal.SIGKILL)
    t0 = time.monotonic()
    code, res = bench("--url", srv.base_url, "--num-prompts", "8", "--input-len", "4", "--output-len", "10",
                      "--concurrency", "4", "--client-processes", "2")
    killer.join()
    assert code == 1 and res is None
    assert time.monotonic() - t0 < 20  # no waiting for the survivors' requests
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "exited with code -9" in err[0], err
    assert _client_pids() == []


def test_cancelling_the_run_stops_the_client_processes(fake_server):
    srv = fake_server(ttft_s=5.0)
    plan = LoadPlan(arrivals=[0.0] * 4, concurrency=4, progress=False, processes=2)

    async def go() -> None:
        task = asyncio.create_task(run_load(_target(srv), [BenchRequest(i, [1], 2) for i in range(4)], plan))
        while len(srv.behaviour.seen) < 4:
            await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(go())
    assert _client_pids() == []


@pytest.fixture
def sigint_handled():
    """Ctrl-C reaches this process and what it starts. A shell starts a background job with SIGINT
    ignored, and a process keeps an ignored signal ignored across exec: a suite run in the
    background failed both Ctrl-C tests (exit 0, the run never interrupted). A handled signal is
    reset to the default in an exec'd child, so Python there raises KeyboardInterrupt again."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_stops_everything(fake_server, sigint_handled):
    """SIGINT to the whole process group, as a terminal's Ctrl-C: exit 130, one line, no traceback,
    no client process left."""
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.5)  # the 2-token test request: 0.5 s; the others 10 s
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.cli", "--url", srv.base_url, "--num-prompts", "4", "--input-len", "4",
         "--output-len", "20", "--concurrency", "4", "--client-processes", "2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # the signal goes only while the run is certainly in progress: every request has reached the
        # server, and each streams for ~10 s more (sent at any other moment, say after the run
        # ended, exit 0 would be right)
        deadline = time.monotonic() + 120
        while len(srv.behaviour.seen) < 1 + 4:  # the test request + the 4 requests
            if proc.poll() is not None:
                pytest.fail(f"exit code {proc.returncode} before the 4 requests: {proc.communicate()[1]}")
            if time.monotonic() > deadline:
                pytest.fail("the 4 requests did not all reach the server within 120 s")
            time.sleep(0.01)
        clients = _workers(proc.pid)
        assert len(clients) == 2
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "serve bench: error: interrupted"
    assert not any(Path(f"/proc/{pid}").exists() for pid in clients)  # stopped and reaped


def test_ctrl_c_while_the_client_processes_start_is_not_lost(fake_server, monkeypatch, sigint_handled):
    """A SIGINT that comes between the start of one client process and the next: the parent blocks
    SIGINT while it starts them (so that they start with it blocked), and handles it once they are
    started. Ignoring it instead lost it: the run went on to its end and `serve bench` exited 0."""
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.5)  # ~10 s a request: too long to finish by chance
    started: list[int] = []
    start = multiprocessing.context.SpawnProcess.start

    def start_then_interrupt(self) -> None:
        start(self)
        started.append(self.pid)
        if len(started) == 1:
            signal.raise_signal(signal.SIGINT)  # to this thread, at once: the Ctrl-C, mid-start

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_then_interrupt)
    plan = LoadPlan(arrivals=[0.0] * 4, concurrency=4, progress=False, processes=2)
    with pytest.raises(KeyboardInterrupt):  # asyncio.run's answer to a SIGINT: the run was cancelled
        asyncio.run(run_load(_target(srv), [BenchRequest(i, [1], 20) for i in range(4)], plan))
    assert len(started) == 2  # both started before the signal was handled
    assert _client_pids() == []
    assert srv.behaviour.seen == []  # stopped before the "go": no request went out


def test_the_progress_bar_advances_while_the_processes_run(fake_server, monkeypatch):
    bars = []

    class RecordingBar:  # stands in for tqdm: when each update came
        def __init__(self, total: int, **_) -> None:
            self.total, self.updates = total, []
            bars.append(self)

        def update(self, n: int) -> None:
            self.updates += [time.perf_counter()] * n

        def close(self) -> None:
            pass

    monkeypatch.setattr("bench.load.tqdm", RecordingBar)
    srv = fake_server(ttft_s=0.01, chunk_interval_s=0.02)
    requests = [BenchRequest(i, [1, 2], 6) for i in range(6)]  # three waves of two, ~0.1 s each
    asyncio.run(run_load(_target(srv), requests, LoadPlan(arrivals=[0.0] * 6, concurrency=2, processes=2)))
    (bar,) = bars
    assert bar.total == 6 and len(bar.updates) == 6
    assert bar.updates[-1] - bar.updates[0] > 0.1  # as each request finished, not all at the end
