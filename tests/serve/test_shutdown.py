"""`serve run` as a real subprocess: what it prints, where it binds (a port in use fails before
the model loads), and SIGTERM.

SIGTERM stops admission at once, lets in-flight requests run for --shutdown-timeout seconds,
aborts the rest with a finish reason their clients see, and exits 0.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from serve.cli import build_parser
from tests.serve.helpers import free_port, serve_run_usage_error

REPO = Path(__file__).resolve().parents[2]


def start_server(model_dir: Path, *extra: str, scheme: str = "http") -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "serve.cli", "run", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
           "--num-kv-blocks", "64", "--port", str(port), "--log-level", "warning", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stdout.read()}")
        try:
            if httpx.get(f"{scheme}://127.0.0.1:{port}/health", timeout=1, verify=False).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not become healthy")


def read_stream(port: int, body: dict, out: list, started: threading.Event) -> None:
    """Collect the finish reasons of one streamed completion; out gets ("ok", reasons) or ("error", text)."""
    reasons, done = [], False
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
        out.append(("ok" if done else "cut", reasons))
    except httpx.HTTPError as e:
        out.append(("error", repr(e)))


def test_a_port_in_use_is_one_line_before_the_model_loads(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        lines = serve_run_usage_error(model_dir, "--device", "cpu", "--port", str(port))
    # one line, nothing before it: no weights were loaded
    assert lines == [f"serve run: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_default_host_is_loopback():
    args = build_parser().parse_args(["run"])
    assert args.host == "127.0.0.1" and args.api_key is None


def child_pids(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is pid."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.append(int(entry.name))
    return out


def engine_children(pid: int) -> list[int]:
    """pid's children that run engines or ranks: not multiprocessing's resource tracker, not the
    server's tokenizing processes."""
    def ours(p: int) -> bool:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return False
        return b"resource_tracker" not in cmd and b"tokenize_worker" not in cmd
    return [p for p in child_pids(pid) if ours(p)]


def is_running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def refused_soon(port: int, body: dict, timeout_s: float) -> bool:
    """Whether new requests are refused (503 or no connection) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=5).status_code == 503:
                return True
        except httpx.HTTPError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("engine_loop, extra", [("thread", []), ("process", []), ("process", ["--api-processes", "2"])])
def test_startup_banner_and_sigterm_aborts_in_flight_requests(model_dir, engine_loop, extra):
    """With two API processes both drain: streams on either end with "abort", and neither listens."""
    proc, port = start_server(model_dir, "--shutdown-timeout", "0.2", "--engine-loop", engine_loop, *extra)
    children = child_pids(proc.pid)
    if engine_loop == "process":
        assert engine_children(proc.pid)  # the engine process
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
        results: list = []
        events = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=read_stream, args=(port, body, results, e)) for e in events]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in events)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # admission stops: each API process refuses once it has the signal, then closes its socket
        assert refused_soon(port, {**body, "max_tokens": 1}, 10)
        code = proc.wait(timeout=20)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
        output = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, output
    assert elapsed < 10, elapsed
    deadline = time.monotonic() + 5
    while any(is_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_running(pid) for pid in children), "orphaned child processes"
    # every client saw its stream end properly, with finish_reason "abort", then [DONE]
    assert results == [("ok", ["abort"])] * 3, results
    assert f"http://127.0.0.1:{port}/v1" in output
    assert f"model {model_dir.name}" in output and "KV cache 1024 tokens" in output and "context 512 tokens" in output
    assert f"engine loop: {engine_loop}" in output
    assert ("pagedserve: 2 API processes" in output) == bool(extra), output
    assert "Traceback" not in output, output


def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones(model_dir):
    """The drain behind SIGTERM, in process: with time to spare, in-flight requests finish normally
    while new ones get 503, and /health says the server is going away."""
    import asyncio

    from tests.serve.helpers import ServerThread, build

    with ServerThread(build(model_dir)) as srv:
        body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        results: list = []
        events = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=read_stream, args=(srv.port, body, results, e)) for e in events]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in events)
        drained = asyncio.run_coroutine_threadsafe(srv.state.loop.drain(60), srv.server._loop)
        r = srv.http.post("/v1/completions", json=body)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert srv.http.get("/health").status_code == 503
        drained.result(timeout=30)
        for t in threads:
            t.join(timeout=10)
        assert results == [("ok", ["length"])] * 3, results
