from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pytest

from bench.cli import add_arguments, run
from tests.bench.fake_server import FakeBehaviour, ThreadedServer


@pytest.fixture
def fake_server():
    """Start a fake server with the given behaviour; stopped after the test."""
    started: list[ThreadedServer] = []

    def start(**behaviour) -> ThreadedServer:
        server = ThreadedServer(FakeBehaviour(**behaviour)).__enter__()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__(None, None, None)


@pytest.fixture
def bench(tmp_path: Path, monkeypatch):
    """Run `serve bench` in-process with these arguments; returns (exit code, result JSON or None).
    Temporary files go to tmp_path: the log of a server it starts and that fails (kept for the user)
    is not left in /tmp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def run_bench(*argv: str) -> tuple[int, dict | None]:
        parser = argparse.ArgumentParser(prog="serve bench")
        add_arguments(parser)
        out = tmp_path / "result.json"
        if out.exists():
            out.unlink()
        code = run(parser.parse_args([*argv, "--result-json", str(out)]))
        return code, json.loads(out.read_text()) if out.exists() else None

    return run_bench
