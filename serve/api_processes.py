"""More API processes over one engine process (`serve run --api-processes N`).

One API process's event loop does all of HTTP, request checks and streaming, and every streamed
chunk costs it a socket write: with a small model's many chunks a second, a burst of requests
queues behind the chunks of every stream (bench/NOTES.md, 2026-11-27: the 0.5B's requests waited
~12 ms for the loop before the engine saw them). Here the server process (the first API process)
spawns N - 1 more, each running the same app on the same listening socket (the kernel hands each
new connection to one of them) and driving the engine process over pipes of its own
(scheduler/engine_proc.py: ProcessCore.attach). Sequence ids are disjoint (process i takes i, i + N,
...); the engine process sends each one its sequences' outputs. By default (N not given) two serve
where the engine runs multi-step decode rounds (a host-bound model) on a host of AUTO_MIN_CPUS
cores or more, else one. Measured on H100 hosts (16 cores, 2026-11-27, Qwen2.5-0.5B, 64 clients,
six pairs in three calls): 40.3k against 37.0k output tok/s, text prompts 37.5k against 33.5k.

Lifecycle: the server process starts them as its app starts (when it handles SIGTERM already, and
before it accepts connections: it waits until they serve, so that a client's first connections,
which it keeps, reach all of them), and on SIGTERM tells them to drain and waits for them before
it stops the engine; a Ctrl-C reaches them all at once. An API
process that dies loses its own requests (the engine process aborts its sequences); the server
process then stops the others and exits 1, as it does when the engine dies. Counters and
histograms on /metrics are the sum over the processes (prometheus_client's multiprocess mode,
PROMETHEUS_MULTIPROC_DIR); the engine's gauges are the engine's own, whichever process answers.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from typing import TYPE_CHECKING

from engine.config import EngineConfig, ModelConfig
from scheduler.loop import API_TRACE_ENV, EngineSnapshot
from scheduler.request import describe_exit
from serve.server_config import ServerConfig

if TYPE_CHECKING:
    from serve.engine_process import ProcessEngine

log = logging.getLogger("pagedserve")
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when it is imported
RESPONSES_DIR_ENV = "PAGEDSERVE_RESPONSES_DIR"  # stored /v1/responses, which any process may be asked for
JOIN_MARGIN_S = 10.0  # beyond the drain's time: uvicorn's own shutdown, the lifespan's
START_TIMEOUT_S = 120.0  # importing the server and loading the tokenizer: ~1-3 s
# --api-processes auto: two for a host-bound model on a host with this many cores or more (the engine
# process, two API processes, the tokenizing processes and a client's beside them)
AUTO_MIN_CPUS = 8


def check_api_processes(n: int | None, engine_loop: str, data_parallel_size: int, disaggregated: bool) -> int:
    """The API processes to provision for --api-processes n (None: auto, settled by settle() once
    the engine is built): n, or 2 where more than one could serve (one engine process in a process
    of its own, AUTO_MIN_CPUS cores), else 1. Raises ValueError for an n these flags rule out."""
    one_engine = engine_loop == "process" and data_parallel_size == 1 and not disaggregated
    if n is None:
        return 2 if one_engine and (os.cpu_count() or 1) >= AUTO_MIN_CPUS else 1
    if n < 1:
        raise ValueError(f"--api-processes must be >= 1; got {n}")
    if n > 1 and engine_loop != "process":
        raise ValueError("--api-processes shares an engine process between API processes: drop --engine-loop thread")
    if n > 1 and not one_engine:
        raise ValueError("--api-processes works with one engine process: drop --data-parallel-size / --disaggregate")
    return n


def settle(asked: int | None, provisioned: int, engine: "ProcessEngine") -> int:
    """How many API processes serve: as asked, or for auto the provisioned ones where the engine
    runs multi-step decode rounds (a host-bound model: its streams make many chunks a second), else
    one, and the provisioned channel goes unused."""
    if asked is not None or provisioned == 1 or engine.runner.num_scheduler_steps > 1:
        return provisioned
    for pair in engine.core.channels:
        for conn in pair:
            conn.close()
    engine.core.channels.clear()
    engine.seq_ids = engine.api_process = None
    return 1


def shared_dir(env: str) -> str:
    """A fresh folder the API processes share, named in the environment variable env (they inherit
    it): METRICS_DIR_ENV before prometheus_client is imported, RESPONSES_DIR_ENV before the app is made."""
    path = tempfile.mkdtemp(prefix=f"pagedserve-{env.lower()}-")
    os.environ[env] = path
    return path


def per_process(cfg: ServerConfig, n: int) -> ServerConfig:
    """Each process's share of the server's request rate limit."""
    if cfg.max_request_rate is None or n == 1:
        return cfg
    return replace(cfg, max_request_rate=cfg.max_request_rate / n)


@dataclass(frozen=True)
class WorkerSpec:
    """What an API process needs besides its listening socket and pipes (picklable)."""

    index: int  # 1 .. count - 1 (the server process is 0)
    count: int
    host: str
    port: int
    log_level: str
    server: ServerConfig
    engine: EngineConfig
    model: ModelConfig
    info: object  # serve.engine_process.EngineInfo
    snapshot: EngineSnapshot


class ApiProcesses:
    """The server process's handle on the other API processes; also the app's companion
    (serve/api.py create_app): started() spawns them once the app's engine loop runs, stopping()
    waits for them before the engine stops."""

    def __init__(self, shutdown_timeout_s: float) -> None:
        self.procs: list[BaseProcess] = []
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stopping_now = False
        self.failure: str | None = None
        self.on_death: Callable[[str], None] = lambda message: None
        self._plan: tuple[socket.socket, list[tuple[Connection, Connection]], WorkerSpec] | None = None

    def prepare(self, listener: socket.socket, channels: list[tuple[Connection, Connection]], spec: WorkerSpec) -> None:
        """What started() spawns: one API process per channel on this listening socket."""
        self._plan = (listener, channels, spec)

    async def started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Spawn the API processes and wait until each serves; then watch them. Inside the server's
        start-up: it handles SIGTERM by then (a stop meanwhile drains them too), and it accepts
        connections only after, so a client's first connections, which it keeps, do not all go to
        the server process. One that exits (or hangs) meanwhile, or later while the server is not
        stopping, calls on_death(why)."""
        assert self._plan is not None, "prepare() first"
        ready = self._spawn(*self._plan)
        deadline = time.monotonic() + timeout_s
        for proc, event in zip(self.procs, ready):
            while not event.is_set():
                if self.stopping_now:
                    return
                if not proc.is_alive():
                    proc.join()
                    return self._died(f"API process {proc.name} exited while it started ({describe_exit(proc.exitcode)})")
                if time.monotonic() > deadline:
                    return self._died(f"API process {proc.name} did not start within {timeout_s:.0f} s")
                await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()

        def exited(proc: BaseProcess) -> None:
            loop.remove_reader(proc.sentinel)
            if not self.stopping_now:
                proc.join(1.0)
                self._died(f"API process {proc.name} exited unexpectedly ({describe_exit(proc.exitcode)})")

        for proc in self.procs:
            loop.add_reader(proc.sentinel, exited, proc)

    def _died(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
            self.on_death(why)

    def _spawn(self, listener: socket.socket, channels: list[tuple[Connection, Connection]],
               spec: WorkerSpec) -> list[EventType]:
        """Start the processes (on the main thread: see the SIGINT swap); this process's ends of
        the channels are closed once the processes have theirs. -> their ready events."""
        ctx = mp.get_context("spawn")
        ready = []
        # as for the engine process: an ignored SIGINT while spawn's bootstrap imports our modules
        swap = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if swap else None
        try:
            for i, (commands, results) in enumerate(channels, start=1):
                ready.append(ctx.Event())
                proc = ctx.Process(target=worker_main, name=f"pagedserve-api-{i}",
                                   args=(listener, commands, results, replace(spec, index=i), ready[-1]))
                proc.start()
                self.procs.append(proc)
        finally:
            if swap:
                signal.signal(signal.SIGINT, previous)
            for pair in channels:
                for conn in pair:
                    conn.close()
            channels.clear()
        return ready

    def terminate(self) -> None:
        """Ask every API process to drain (SIGTERM); they stop within their shutdown timeout."""
        self.stopping_now = True
        for proc in self.procs:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)

    async def stopping(self) -> None:
        """Before the engine stops: the API processes drain and exit (the engine serves their
        in-flight requests until they have)."""
        self.terminate()
        await asyncio.get_running_loop().run_in_executor(
            None, self._join_or_kill, self.shutdown_timeout_s + JOIN_MARGIN_S)

    def kill(self) -> None:
        self.stopping_now = True
        self._join_or_kill(0.0)

    def _join_or_kill(self, timeout_s: float) -> None:
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                if timeout_s:
                    log.warning("API process %s did not stop within %.0f s; killing it", proc.name, timeout_s)
                proc.kill()
                proc.join(5.0)


def remove_dirs(*paths: str | None) -> None:
    for path in paths:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


class _Ready:
    """An API process's companion: tells the server process it serves."""

    def __init__(self, event: EventType) -> None:
        self.event = event

    async def started(self) -> None:
        self.event.set()

    async def stopping(self) -> None:
        pass


def worker_main(listener: socket.socket, commands: Connection, results: Connection, spec: WorkerSpec,
                ready: EventType) -> None:
    """An API process: the app on the shared socket, over its own channel to the engine process.
    Sets `ready` once it serves; exits 1 if the engine died under it."""
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if os.environ.get(API_TRACE_ENV):  # a trace file of its own (scheduler/loop.py AsyncEngine)
        os.environ[API_TRACE_ENV] += f".{spec.index}"
    try:
        code = _serve(listener, commands, results, spec, ready)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signals
        code = 0
    os._exit(code)  # the tokenizer's and loop's threads are done with: no interpreter teardown to wait for


def _serve(listener: socket.socket, commands: Connection, results: Connection, spec: WorkerSpec,
           ready: EventType) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from serve.run_cmd import serve_app, sigint_deferred

    with sigint_deferred():  # as the server process imports these (a Ctrl-C inside pydantic's schemas)
        importlib.import_module("serve.uvicorn_server")  # uvicorn, for serve_app
        from scheduler.engine_proc import ProcessCore
        from serve.api import create_app
        from serve.build import load_tokenizer, model_folder_config
        from serve.engine_process import ProcessEngine

    path, _ = model_folder_config(spec.engine, show_progress=False)
    engine = ProcessEngine(ProcessCore.attach(commands, results, spec.snapshot), load_tokenizer(path), spec.model,
                           spec.engine, spec.info, itertools.count(spec.index, spec.count), spec.index)
    app = create_app(engine, spec.server, _Ready(ready))
    failure = serve_app(app, listener, spec.host, spec.port, spec.log_level, spec.server.shutdown_timeout_s)
    return 1 if failure is not None else 0
