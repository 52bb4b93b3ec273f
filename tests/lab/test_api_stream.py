"""lab/api_stream.py at tiny sizes: the app alone streams one chunk per stream and step; a short run
of the real server, fake engine process and client measures chunks, CPU and gaps (no timed asserts)."""
from __future__ import annotations

import json

from lab import api_stream


def test_the_app_alone_writes_one_chunk_per_stream_and_step(tiny_models, tmp_path, capsys):
    out = tmp_path / "app.json"
    api_stream.main(["app", "--model", str(tiny_models["llama"]), "--streams", "3", "--steps", "7", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["chunks"] == 3 * 7 and d["cpu_us_per_chunk"] > 0 and d["bytes_per_chunk"] > 100


def test_a_short_run_measures_the_server(tiny_models, tmp_path):
    out = tmp_path / "run.json"
    api_stream.main(["run", "--model", str(tiny_models["llama"]), "--streams", "2", "--step-ms", "20",
                     "--max-tokens", "8", "--warmup", "0.5", "--seconds", "1.5", "--stack", "asyncio",
                     "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["chunks_per_s"] > 0 and row["server_cpu_us_per_chunk"] > 0 and row["gap_median_ms"] > 0
    assert row["engine_step_median_ms"] > 0 and row["lost_connections"] == 0
    assert set(row["gc_pauses"]) == {"0", "1", "2"}
