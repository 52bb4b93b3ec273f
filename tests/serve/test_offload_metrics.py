"""/metrics and `serve kv-calc` for the host tier of the prefix cache: hits per tier, bytes each
way, occupancy; the tier's capacity in tokens."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from scheduler.loop import EngineSnapshot
from serve import kv_calc_cmd as cmd
from serve.metrics import Metrics


@dataclass
class StubEngine:
    snapshot: EngineSnapshot
    num_waiting: int = 0
    observer: object = None


def test_host_tier_series():
    snap = EngineSnapshot(prefix_cache_queries=1000, prefix_cache_hits=600, prefix_cache_host_hits=250,
                          kv_offload_bytes_out=4096, kv_offload_bytes_in=2048, host_kv_used_blocks=7,
                          host_kv_total_blocks=64)
    text = Metrics("m", StubEngine(snap)).render().decode()
    assert 'pagedserve:prefix_cache_tier_hits_total{model_name="m",tier="device"} 350.0' in text
    assert 'pagedserve:prefix_cache_tier_hits_total{model_name="m",tier="host"} 250.0' in text
    assert 'pagedserve:kv_offload_bytes_total{direction="out",model_name="m"} 4096.0' in text
    assert 'pagedserve:kv_offload_bytes_total{direction="in",model_name="m"} 2048.0' in text
    assert 'pagedserve:host_kv_cache_used_blocks{model_name="m"} 7.0' in text
    assert 'pagedserve:host_kv_cache_total_blocks{model_name="m"} 64.0' in text


def test_no_host_tier_no_series():
    text = Metrics("m", StubEngine(EngineSnapshot(prefix_cache_queries=1, prefix_cache_hits=0))).render().decode()
    assert "host_kv_cache" not in text and "kv_offload_bytes" not in text


def test_kv_calc_shows_the_host_tier(capsys):
    def run(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="serve kv-calc")
        cmd.add_arguments(parser)
        return cmd.run(parser.parse_args(["--model", "Llama-3-8B", "--gpu-memory", "H100", *argv]))

    assert run("--kv-offload-gib", "64") == 0
    out = capsys.readouterr().out
    assert "host tier (64 GiB)" in out and "524,288" in out  # 64 GiB / 128 KiB per token
    assert run("--kv-offload-gib", "64", "--json") == 0
    got = json.loads(capsys.readouterr().out)
    assert got["host_tokens"] == 524288 and got["host_blocks"] == 32768
    assert run("--kv-offload-gib", "-1") == 2
    assert "--kv-offload-gib must be >= 0" in capsys.readouterr().err
