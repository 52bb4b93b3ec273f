"""lab/host_step.py at tiny sizes: every timed step is a decode step of every sequence, and the
burst of prefix-sharing requests is admitted in one schedule() call, sharing the prefix."""
from __future__ import annotations

import json

from lab import host_step


def test_host_step_times_decode_steps_and_a_prefix_burst(tiny_models, tmp_path, capsys):
    out = tmp_path / "host.json"
    rc = host_step.main(["--model", str(tiny_models["llama"]), "--num-seqs", "4", "--prompt-len", "20",
                         "--steps", "5", "--prefix-seqs", "4", "--prefix-prompt-len", "40", "--prefix-len", "32",
                         "--prefix-reps", "2", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d == json.loads(capsys.readouterr().out)
    assert d["async_scheduling"] is True
    dec = d["decode"]
    assert dec["steps"] == 5 and dec["outputs"] == 4 * 5  # one token per sequence and step
    assert 0 < dec["min_ms"] <= dec["median_ms"] and dec["cpu_mean_ms"] > 0 and dec["pickle_median_ms"] > 0
    phases = d["decode_phases"]
    assert {"schedule", "launch", "collect", "process", "pickle", "other"} <= set(phases)
    assert all(phases[k] > 0 for k in ("schedule", "launch", "collect", "process", "pickle"))
    pre = d["prefix_admission"]
    assert pre["admitted_min"] == 4 and pre["first_ms"] > 0 and pre["median_ms"] > 0
    # the 2 full blocks of the shared prefix are computed once: by the first request of the first burst
    assert pre["hit_rate"] == (3 * 32 + 4 * 32) / (2 * 4 * 40)
