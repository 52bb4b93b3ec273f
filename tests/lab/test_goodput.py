"""lab/goodput.py: goodput recomputed per objective from sweep results, absolute and relative to the
roofline decode step; the tables compare setups."""
from __future__ import annotations

import json

import pytest

from lab.goodput import Objective, main


def sweep(rates, ttfts, tpot_ms=10.0, duration_s=2.0, tok_s=1000.0) -> dict:
    runs = [{"request_rate": rate, "duration_s": duration_s, "request_throughput": len(ttfts) / duration_s,
             "output_throughput": tok_s * (k + 1), "num_prompts": len(ttfts), "input_len": 512, "output_len": 256,
             "range_ratio": 0.5, "temperature": 0.8, "roofline_decode_step_ms": 8.0,
             "requests": [{"ttft_ms": t * (k + 1), "tpot_ms": tpot_ms, "e2el_ms": 1.0, "error": None} for t in ttfts]
             + [{"ttft_ms": None, "tpot_ms": None, "e2el_ms": None, "error": "HTTP 500"}]}
            for k, rate in enumerate(rates)]
    return {"date": "2026-11-26T05:00:00+00:00", "gpu": "H100", "model": "llama3-8b", "server_args": "",
            "runs": runs}


def test_objectives():
    run = sweep([4.0], [100.0, 300.0, 900.0])["runs"][0]
    assert Objective.parse("x=ttft:500").goodput(run, None) == 1.0  # 2 good of 3 (and a failure) over 2 s
    assert Objective.parse("x=ttft:500,tpot:1.25x").goodput(run, 8.0) == 1.0  # tpot 10 <= 1.25 x 8
    assert Objective.parse("x=ttft:500,tpot:1.2x").goodput(run, 8.0) == 0.0
    with pytest.raises(ValueError, match="relative to the roofline"):
        Objective.parse("x=tpot:2x").goodput(run, None)
    with pytest.raises(ValueError, match="KEY:MS"):
        Objective.parse("x=latency:5")
    with pytest.raises(ValueError, match="NAME="):
        Objective.parse("ttft:5")


def test_tables_and_plot(tmp_path, capsys):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(sweep([4.0, 8.0], [100.0, 300.0])))
    dp = sweep([4.0, 8.0], [100.0, 100.0], tok_s=1900.0)
    for run in dp["runs"]:
        run["roofline_decode_step_ms"] = 4.0  # its own roofline splits the step: the baseline's counts
    two.write_text(json.dumps(dp))
    png, md = tmp_path / "g.png", tmp_path / "g.md"
    sat1, sat2 = tmp_path / "s1.json", tmp_path / "s2.json"
    sat1.write_text(json.dumps({"output_throughput": 7000.0, "concurrency": 128, "server_args": ""}))
    sat2.write_text(json.dumps({"output_throughput": 14000.0, "concurrency": 256, "server_args": "-dp 2"}))
    assert main([f"{one}=1gpu", f"{two}=dp2", "--slo", "loose=ttft:2000", "--slo", "tight=ttft:250,tpot:1.25x",
                 "--saturated", f"{sat1}=1gpu", "--saturated", f"{sat2}=dp2",
                 "--plot", str(png), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "| dp2 | `` | 3,800 | 1.90x | 1.00 |" in out
    assert "| dp2 | `-dp 2` | 256 | 14,000 | 2.00x |" in out
    assert "Goodput (req/s), tight: ttft <= 250 ms, tpot <= 1.25x roofline step (10.0 ms)" in out
    # at 8 req/s the TTFTs double: 1gpu's 200 and 600 ms, dp2's 200 and 200 ms
    assert "| 8 | 0.50 | 1.00 | 1.00 | 1.00 |" in out
    assert md.read_text() == out.rstrip("\n") + "\n" and png.stat().st_size > 10_000
    assert main([str(tmp_path / "missing.json")]) == 2
    assert main([f"{one}=1gpu", "--saturated", str(one)]) == 2  # a sweep is not a closed-loop run
