"""Start our own server as a subprocess for the run, wait until it is healthy, stop it after.

The command line is `<command> --model DIR [--load-format F] [--served-model-name N]
--host 127.0.0.1 --port P <extra args>`, with command `serve run` by default. Its output goes to
a log file, whose tail is shown when it fails to come up, and from which the engine's start-up
cost model is read (the forward sizes and times it budgets its steps by, engine/runner.py).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
# engine/runner.py's log line of its step cost model (rank 0's: a pipeline's first stage)
COST_MODEL_LINE = re.compile(r"step cost model.*?: a forward of ([0-9/]+) rows ([0-9./]+) ms")


class ServerError(RuntimeError):
    """The server could not be started or did not become healthy; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float) -> None:
    """Until GET base_url/health answers 200; ServerError if proc exits first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise ServerError(f"the server exited with code {code} before it was healthy")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise ServerError(f"the server was not healthy after {timeout_s:.0f} s")


def resolve_command(command: str) -> list[str]:
    """Split a command string; a bare program name is looked up beside this Python first, so that
    `serve` from the same virtual environment is found even when it isn't on PATH."""
    argv = shlex.split(command)
    if not argv:
        raise ValueError("--server-command is empty")
    beside = Path(sys.executable).parent / argv[0]
    if os.sep not in argv[0] and beside.is_file() and os.access(beside, os.X_OK):
        argv[0] = str(beside)
    elif shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
        raise ValueError(f"--server-command: {argv[0]!r} is not a program on PATH")
    return argv


@dataclass
class ManagedServer:
    command: list[str]
    model: str
    load_format: str | None = None
    served_model_name: str | None = None
    extra_args: list[str] = field(default_factory=list)
    port: int = 0  # 0: pick a free one
    startup_timeout_s: float = 900.0
    log_path: Path | None = None  # None: a temporary file, removed after a run without error
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _temp_log: bool = field(default=False, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def argv(self) -> list[str]:
        argv = [*self.command, "--model", self.model]
        if self.load_format:
            argv += ["--load-format", self.load_format]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        return [*argv, "--host", HOST, "--port", str(self.port), *self.extra_args]

    def __post_init__(self) -> None:
        if self.port == 0:
            self.port = free_port()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="serve-bench-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            self._temp_log = True

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            # a session of its own: a Ctrl-C at the terminal reaches us, and we stop it in order
            self._proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:  # Ctrl-C or a failed start: never leave the server behind
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        try:
            wait_healthy(self._proc, self.base_url, self.startup_timeout_s)
        except ServerError as e:
            raise ServerError(f"{e}; log {self.log_path}: {self.log_tail()}") from None

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def step_cost_model(self) -> dict | None:
        """The engine's start-up cost model as its log gives it: {"rows": [...], "forward_ms": [...]};
        None where the log has none (a CPU engine, another server)."""
        try:
            m = COST_MODEL_LINE.search(self.log_path.read_text(errors="replace"))
        except OSError:
            return None
        if m is None:
            return None
        return {"rows": [int(r) for r in m[1].split("/")], "forward_ms": [float(t) for t in m[2].split("/")]}

    def stop(self, grace_s: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            proc.send_signal(sig)
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "ManagedServer":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        if exc_type is None and self._temp_log:
            self.log_path.unlink(missing_ok=True)
