"""lab/steps.py on the CPU: every step is recorded, split into decode-only and with-prefill."""
from __future__ import annotations

import json

from lab import steps


def test_steps_records_every_step(tiny_models, tmp_path, capsys):
    out = tmp_path / "steps.json"
    rc = steps.main(["--model", str(tiny_models["llama"]), "--load-format", "auto", "--num-prompts", "3",
                     "--input-len", "20", "--output-len", "4", "--max-num-batched-tokens", "32",
                     "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    recs = d["records"]
    # 60 prompt tokens at 32 per step: at least two steps carry prefill; 3 x 3 decodes after the first tokens
    assert d["with_prefill"]["steps"] >= 2 and d["decode_only"]["steps"] >= 1
    assert d["with_prefill"]["steps"] + d["decode_only"]["steps"] == len(recs)
    assert sum(r["tokens"] for r in recs) == 3 * 20 + 3 * 3
    assert all(r["launch_ms"] >= 0 and r["tokens"] <= 32 for r in recs)
    assert d["triton_compiles_in_run"] >= 0 and "records" not in json.loads(capsys.readouterr().out)
