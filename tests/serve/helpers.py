"""A real uvicorn server on 127.0.0.1 in a background thread, around an engine built from a folder.

build() gives an engine whose core steps on a thread of this process; build_process() one whose core
runs in a child process (`--engine-loop process`). ServerThread.call(fn) runs fn(core) where the core
is: in process mode fn must be a module-level function, hence the small functions below.

For a `serve run` subprocess (tests/serve/test_shutdown.py's start_server): client_of() and the
/metrics readers below it; serve_run_usage_error() for flags it refuses.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn

from engine.config import EngineConfig
from scheduler.core import EngineCore
from serve.api import ServerState, create_app
from serve.build import Engine, build_engine
from serve.engine_process import ProcessEngine, start_engine_process
from serve.server_config import ServerConfig
from serve.uvicorn_server import DrainingServer

T = TypeVar("T")
HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def engine_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    base = dict(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=32,
                max_num_batched_tokens=512)
    return EngineConfig(**{**base, **overrides})


class ServerThread:
    """`with ServerThread(engine, config) as srv:` serves on srv.base_url until the block ends."""

    def __init__(self, engine: Engine | ProcessEngine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig(shutdown_timeout_s=1.0)
        self.app = create_app(engine, self.config)
        self.port = free_port()
        self.server = DrainingServer(uvicorn.Config(self.app, host=HOST, port=self.port, log_level="warning",
                                                   timeout_graceful_shutdown=int(self.config.shutdown_timeout_s) + 5),
                                     on_exit=lambda: self.state.loop.drain(self.config.shutdown_timeout_s))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.http = httpx.Client(base_url=self.base_url, timeout=60)  # one pool: a new client costs ~50 ms

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if isinstance(self.engine, ProcessEngine):
            self.engine.shutdown()  # a no-op once the app's shutdown has stopped it

    def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run fn(core) between steps, on the engine's worker thread or in its process."""
        future = asyncio.run_coroutine_threadsafe(self.state.loop.call(fn), self.server._loop)
        return future.result(timeout=30)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until nothing runs or waits and every KV block is free; then check the allocator."""
        deadline = time.monotonic() + timeout
        while True:
            running, waiting, used = self.call(core_counts)
            if (running, waiting, used) == (0, 0, 0) and self.state.loop.num_in_flight == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout}s: {running} running, {waiting} waiting, "
                                     f"{used} blocks used, {self.state.loop.num_in_flight} streams")
            time.sleep(0.02)
        self.call(check_integrity)
        assert not self.call(num_detokenizers), "detokenizer state leaked"

    def metrics(self) -> dict[str, float]:
        """name{labels} -> value, parsed with prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.http.get("/metrics").text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@dataclass
class SubprocessServer:
    """A `serve run` child process and a client for it."""

    proc: subprocess.Popen
    url: str
    http: httpx.Client


@contextmanager
def client_of(proc: subprocess.Popen, port: int) -> Iterator[SubprocessServer]:
    """The server started as proc, listening on port; at the end it gets SIGTERM and is waited for,
    unless it has exited."""
    url = f"http://{HOST}:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            yield SubprocessServer(proc, url, http)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)


def serve_run_usage_error(model_dir: Path, *args: str) -> list[str]:
    """`serve run` with these flags and no GPU visible must exit 2 at once: its stderr lines."""
    cmd = [sys.executable, "-m", "serve.cli", "run", "--model", str(model_dir), "--port", str(free_port()), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    return r.stderr.strip().splitlines()


def metric_samples(http: httpx.Client, name: str, **labels: str) -> list[Any]:
    """The samples of the series `name` on /metrics that have these labels."""
    return page_samples(http.get("/metrics").text, name, **labels)


def page_samples(text: str, name: str, **labels: str) -> list[Any]:
    """metric_samples of one /metrics page (several series of one moment)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


@contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block and continued after it: engines held where they
    are, their last state the server's, while a test reads it."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def wait_gauges(read: Callable[[str], Any], idle: Any, timeout: float) -> None:
    """Until read(gauge) == idle for the gauges of running, waiting and KV blocks used."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = [read(f"pagedserve:{name}")
                  for name in ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks")]
        if gauges == [idle] * 3:
            return
        assert time.monotonic() < deadline, f"not idle after {timeout}s: running, waiting, blocks {gauges}"
        time.sleep(0.02)


def build(model_dir: Path, **overrides: Any) -> Engine:
    return build_engine(engine_config(model_dir, **overrides), show_progress=False)


def build_process(model_dir: Path, **overrides: Any) -> ProcessEngine:
    return start_engine_process(engine_config(model_dir, **overrides), show_progress=False)


def core_counts(core: EngineCore) -> tuple[int, int, int]:
    return len(core.scheduler.running), len(core.scheduler.waiting), core.block_manager.num_used_blocks


def used_blocks(core: EngineCore) -> int:
    return core.block_manager.num_used_blocks


def check_integrity(core: EngineCore) -> None:
    core.scheduler.check_integrity()


def num_detokenizers(core: EngineCore) -> int:
    return len(core.detok)


class ScheduleRecorder:
    """Wraps a scheduler's schedule(): the sequences each batch starts (prompt from token 0) and
    how many calls found nothing to run."""

    def __init__(self, schedule: Callable) -> None:
        self.schedule = schedule
        self.started: list[list[int]] = []
        self.empty = 0

    def __call__(self, now: float | None = None):
        batch = self.schedule(now)
        if batch is None:
            self.empty += 1
        else:
            new = [it.seq.seq_id for it in batch.items if it.start == 0]
            if new:
                self.started.append(new)
        return batch


def record_schedules(core: EngineCore) -> None:
    core.scheduler.schedule = ScheduleRecorder(core.scheduler.schedule)


def recorded_schedules(core: EngineCore) -> tuple[list[list[int]], int]:
    rec = core.scheduler.schedule
    return rec.started, rec.empty
