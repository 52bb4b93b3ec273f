"""lab/moe_gpu.py --sweep's logic at tiny shapes on the CPU (the kernels under TRITON_INTERPRET=1),
its GPU candidates against an H100's limits (compiled for sm_90 here: Triton's own ptxas), and
its command line without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.moe import Plan, Tiles
from lab import moe_gpu as mg
from tests.kernels.util import HAS_CUDA

ROOT = Path(__file__).resolve().parents[2]


def _tiny(out: Path) -> mg.Sweep:
    return mg.Sweep(out=out, iters=1, threads=2, sizes=(10, 16), decode_t=2, hidden=32, experts=4, top_k=2, width=16,
                    dtype="float32", device="cpu", decode_layers=1,
                    gate_up_tiles={16: [(16, 32, 1, 1)], 32: [(16, 16, 1, 1)]},
                    down_tiles={16: [(32, 32, 1, 1)], 32: [(16, 32, 1, 1)]}, groups=(2,), tol=1e-4)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU run of the sweep")
def test_sweep_on_cpu(tmp_path):
    cfg = _tiny(tmp_path / "sweep.json")
    res = mg.sweep(cfg, {"gpu": None}, 1e12, 1e12)
    assert json.loads(cfg.out.read_text()) == json.loads(json.dumps(res))
    kernels = res["kernels"]
    # 2 row tiles x 4 gate/up modes + 2 x 2 down modes, at each size; then 3 program orders on
    # each kernel's (up to) two fastest per row tile
    first = [r for r in kernels if r["plan"]["group_m"] == 0 and (r["plan"]["down"] or {}).get("group_m", 0) == 0]
    assert len(first) == 2 * (8 + 4)
    assert len(kernels) - len(first) == 2 * 2 * (2 + 2)  # sizes x row tiles x (2 gate/up + 2 down)
    assert all(r["ok"] and r["rel_err"] < 1e-4 and r["ms"] > 0 for r in kernels), [r for r in kernels if not r["ok"]]
    assert res["compile"][0]["compiles"] == 8 + 4 + len(mg.DECODE_MODES) and res["compile"][0]["failed"] == 0
    for t in ("10", "16"):
        best = res["best"][t]
        assert best["layer"]["ok"] and best["layer"]["ms"] <= best["plan_pick"]["ms"]
        assert best["gate_up"]["kernel"] == "gate_up" and best["down"]["kernel"] == "down"
        # the repr is the Plan to paste into plan()
        assert eval(best["layer"]["plan"]["repr"], {"Plan": Plan, "Tiles": Tiles}) == mg._plan_from(best["layer"])
    assert len([r for r in res["layers"] if r["ok"]]) == 2 * 3
    assert [r["ok"] for r in res["decode"]] == [True] * len(mg.DECODE_MODES)
    assert len(res["dense_equivalent"]) == 2


def test_gpu_candidates():
    """The lists the GPU run times: power-of-two tiles, the shared memory of the pipeline's stages
    within an H100's (a lower bound: --sm90 compiles them for the real figure), not too many."""
    cfg = mg.Sweep(out=Path(os.devnull))
    gate_ups, downs = mg.gate_up_candidates(cfg), mg.down_candidates(cfg)
    assert len(gate_ups) <= 40 and len(downs) <= 24 and len(set(gate_ups)) == len(gate_ups)
    for p in gate_ups + downs:
        for v in (p.block_m, p.block_n, p.block_k, p.down_tiles().block_n, p.down_tiles().block_k):
            assert v & (v - 1) == 0
    for p in gate_ups:
        assert p.num_stages * (p.block_m + 2 * p.block_n) * p.block_k * 2 <= mg.SM90_SHARED
    for p in downs:
        d = p.down_tiles()
        assert d.num_stages * (p.block_m + d.block_n) * d.block_k * 2 <= mg.SM90_SHARED


def test_candidates_compile_for_h100():
    """A few of the GPU candidates (each gate/up mode at the largest tile, the down kernel with
    TMA) compiled for sm_90: wgmma, TMA where asked, no spills, shared memory within an H100's."""
    code = ("import json; from pathlib import Path; from lab import moe_gpu as mg; from kernels import moe\n"
            "cfg = mg.Sweep(out=Path('x'))\n"
            "for fused, tma in mg.GATE_UP_MODES:\n"
            "    print(json.dumps(mg.sm90_report('gate_up', moe.Plan(128, 128, 64, 8, 4, 0, tma, fused), cfg)))\n"
            "down = moe.Plan(128, 128, 64, 8, 3, down=moe.Tiles(256, 64, 8, 3, 0, True))\n"
            "print(json.dumps(mg.sm90_report('down', down, cfg)))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 5
    for r in rows:
        assert r["fits"] and r["wgmma"] and r["tma"] == r["label"].endswith("tma"), r


@pytest.mark.skipif(HAS_CUDA, reason="the message of a machine without a GPU")
def test_command_line_without_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        mg.main(["--help"])
    assert e.value.code == 0 and "--sweep" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        mg.main(["--sweep", "--out", str(tmp_path / "x.json")])
    assert "needs a CUDA GPU" in str(e.value.code) and not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit) as e:
        mg.main(["--sweep"])
    assert e.value.code == 2  # --out is needed
