"""lab/mixed_steps.py at tiny sizes: every round's first step carries the decodes and the new
prompts together, and each such step's launch (with its prepare) is timed."""
from __future__ import annotations

import json

from lab import mixed_steps


def test_mixed_steps_times_decodes_plus_new_prompts(tiny_models, tmp_path, capsys):
    out = tmp_path / "mixed.json"
    rc = mixed_steps.main(["--model", str(tiny_models["llama"]), "--load-format", "auto", "--decodes", "3",
                           "--prompts", "2", "--input-len", "20", "--rounds", "4", "--no-pdl", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert {k: v for k, v in d.items() if k != "records"} == json.loads(capsys.readouterr().out)
    assert d["mixed"]["steps"] == 4  # one per round, with all 3 decodes beside the 2 prompts
    mixed = [r for r in d["records"] if r["mixed"] and r["decodes"] == 3]
    assert all(r["tokens"] == 3 + 2 * 20 for r in mixed)
    assert all(0 < r["prepare_ms"] <= r["launch_ms"] for r in mixed)
    assert d["decode_only"]["steps"] == 4 * 2  # --decode-steps 2 after each mixed step
    assert d["prefix_cache_hits"] == 0  # random prompts


def test_shared_prefix_puts_the_new_chunks_after_a_cached_prefix(tiny_models, tmp_path, capsys):
    out = tmp_path / "mixed.json"
    rc = mixed_steps.main(["--model", str(tiny_models["llama"]), "--load-format", "auto", "--decodes", "3",
                           "--prompts", "2", "--input-len", "20", "--shared-prefix", "32", "--rounds", "3",
                           "--decode-steps", "0", "--out", str(out)])
    assert rc == 0
    capsys.readouterr()
    d = json.loads(out.read_text())
    mixed = [r for r in d["records"] if r["mixed"] and r["decodes"] == 3]
    # the warm-up's first round computes the 32 shared tokens; from then on every prompt finds them
    # cached and its chunk is only its own 20 tokens
    assert len(mixed) == 3 and all(r["tokens"] == 3 + 2 * 20 for r in mixed)
    assert d["prefix_cache_hits"] == 3 * 2 * 32
