"""`serve bench --request-rate R1,R2,...`: one run per rate against a fake server whose first tokens
come one request at a time (so that its queue, and TTFT, grow with the rate); goodput against rate
in the table, the result JSON and the plot."""
from __future__ import annotations

import pytest

from bench.cli import main
from bench.metrics import SLO
from bench.sweep import SweepPoint, best_rate, format_table
from bench.workload import WorkloadSpec, fresh_tokens, make_requests

# seed 15 at 4 req/s: no two of the 8 arrivals are closer than 84 ms, more than a first token's 40 ms
ARGS = ("--num-prompts", "8", "--input-len", "6", "--output-len", "3", "--seed", "15", "--ignore-eos")


def test_goodput_falls_past_saturation(fake_server, bench, capsys, tmp_path):
    srv = fake_server(ttft_s=0.04, chunk_interval_s=0.002, serial_first_tokens=True)
    png = tmp_path / "sweep.png"
    code, res = bench("--url", srv.base_url, *ARGS, "--request-rate", "4,1000", "--goodput", "ttft:150",
                      "--plot", str(png))
    assert code == 0
    low, high = res["goodput_table"]
    assert res["request_rates"] == [4.0, 1000.0] and (low["request_rate"], high["request_rate"]) == (4.0, 1000.0)
    assert (low["completed"], high["completed"]) == (8, 8)
    # all at once, the 8 first tokens take 40 ms each in turn: only the first 3 come within 150 ms
    assert low["good_fraction"] == 1.0 and high["good_fraction"] <= 0.5
    assert low["goodput"] == pytest.approx(low["request_throughput"])
    assert high["p99_ttft_ms"] > 250 > 150 > low["p99_ttft_ms"]
    assert res["slo"] == {"ttft_ms": 150.0} and res["best"]["request_rate"] in (4.0, 1000.0)
    # each run in full, as a single-rate run writes it
    assert [run["request_rate"] for run in res["runs"]] == [4.0, 1000.0]
    assert all(len(run["requests"]) == 8 and run["goodput"] is not None for run in res["runs"])
    out = capsys.readouterr().out
    assert "Goodput vs request rate" in out and "objectives: ttft_ms <= 150" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("4 ", "1000 "))]
    assert [r[0] for r in rows] == ["4", "1000"] and rows[0][5] == "100%"
    assert png.stat().st_size > 10_000
    # the second run sent the same lengths with other tokens: nothing cached from the first helps it
    sent = [b["prompt"] for b in srv.behaviour.seen[1:]]  # after the probe
    first, second = sent[:8], sent[8:]
    assert sorted(map(len, first)) == sorted(map(len, second)) and not set(map(tuple, first)) & set(map(tuple, second))


def test_a_single_rate_is_a_single_run(fake_server, bench):
    srv = fake_server(ttft_s=0.005, chunk_interval_s=0.002)
    code, res = bench("--url", srv.base_url, *ARGS, "--request-rate", "50")
    assert code == 0 and res["request_rate"] == 50.0 and "goodput_table" not in res


def test_without_objectives_the_table_says_so(fake_server, bench, capsys):
    srv = fake_server(ttft_s=0.005, chunk_interval_s=0.002)
    code, res = bench("--url", srv.base_url, *ARGS, "--request-rate", "100,inf")
    assert code == 0
    assert [p["request_rate"] for p in res["goodput_table"]] == [100.0, None]
    assert all(p["goodput"] is None for p in res["goodput_table"]) and res["best"] is None
    out = capsys.readouterr().out
    assert "objectives: none (pass --goodput" in out and any(line.strip().startswith("inf ") for line in out.splitlines())


@pytest.mark.parametrize("rates, message", [("10,x", "'x' is not a number"), ("10,,20", "'' is not a number"),
                                            ("5,0", "--request-rate must be > 0, got 0.0")])
def test_bad_rates_are_one_line(rates, message, capsys):
    try:
        code = main(["--url", "http://127.0.0.1:9", "--request-rate", rates])
    except SystemExit as e:  # argparse's own error
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("serve bench: error: ")


def test_fresh_tokens_keep_lengths_and_the_shared_prefix():
    spec = WorkloadSpec(num_prompts=5, input_len=20, output_len=4, range_ratio=0.5, shared_prefix_len=6, seed=2)
    base = make_requests(spec)
    assert fresh_tokens(base, spec, 0) is base
    again = fresh_tokens(base, spec, 1)
    assert [len(r.prompt) for r in again] == [len(r.prompt) for r in base]
    assert [r.output_len for r in again] == [r.output_len for r in base]
    assert all(a.prompt[:6] == b.prompt[:6] and a.prompt[6:] != b.prompt[6:] for a, b in zip(again, base))
    assert fresh_tokens(base, spec, 1) == again != fresh_tokens(base, spec, 2)


def test_table_and_best_rate():
    def point(rate, goodput):
        return SweepPoint(rate, 10, 0, 5.0, goodput, None if goodput is None else goodput / 5.0, 100.0,
                          10.0, 20.0, 1.0, 2.0, 3.0)

    points = [point(1.0, 1.0), point(2.0, 2.0), point(4.0, 2.0), point(None, 0.5)]
    assert best_rate(points).request_rate == 2.0  # the lowest rate of the highest goodput
    assert best_rate([point(1.0, None)]) is None
    text = format_table(points, SLO(ttft_ms=500, tpot_ms=50))
    assert "objectives: ttft_ms <= 500, tpot_ms <= 50" in text
    assert "best goodput: 2.00 req/s at 2 req/s offered" in text


def test_the_roofline_counts_every_replicas_gpus():
    from bench.cli import roofline_gpus

    assert roofline_gpus(None, ["--data-parallel-size", "2"]) == 2
    assert roofline_gpus(None, ["-dp", "2", "--tensor-parallel-size=2"]) == 4
