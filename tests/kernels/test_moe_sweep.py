"""lab/moe_gpu.py --sweep's logic at tiny shapes on the CPU (the kernels under TRITON_INTERPRET=1),
its GPU candidates against an H100's limits (compiled for sm_90 here: Triton's own ptxas), and
its command line without a GPU."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from kernels import moe
from kernels.moe import Plan, Tiles
from lab import moe_gpu as mg
from tests.kernels.util import HAS_CUDA, run_outside_interpreter


def _tiny(out: Path) -> mg.Sweep:
    return mg.Sweep(out=out, iters=1, threads=2, sizes=(10, 16), decode_t=2, hidden=32, experts=4, top_k=2, width=16,
                    dtype="float32", device="cpu", decode_layers=1,
                    gate_up_tiles={16: [(16, 32, 1, 1)], 32: [(16, 16, 1, 1)]}, gate_up_modes=mg.DECODE_MODES,
                    down_tiles={16: [(32, 32, 1, 1)], 32: [(16, 32, 1, 1)]}, down_tma=(False, True), first_group=0,
                    groups=(2,), tol=1e-4, persistent=(False,))


@pytest.mark.skipif(HAS_CUDA, reason="the CPU run of the sweep")
def test_sweep_on_cpu(tmp_path):
    cfg = _tiny(tmp_path / "sweep.json")
    res = mg.sweep(cfg, {"gpu": None, "date": "today", "triton": "x"}, 1e12, 1e12)
    assert json.loads(cfg.out.read_text()) == json.loads(json.dumps(res))
    kernels = res["kernels"]
    # 2 row tiles x 4 gate/up modes + 2 x 2 down modes, at each size; then group_m 2 on each
    # kernel's two fastest per row tile at each size (their union), timed at every size
    first = [r for r in kernels if r["plan"]["group_m"] == 0 and (r["plan"]["down"] or {}).get("group_m", 0) == 0]
    assert len(first) == 2 * (8 + 4)
    grouped = len(kernels) - len(first)
    assert 2 * 2 * (2 + 2) <= grouped <= 2 * 2 * (4 + 2) and grouped % 2 == 0
    assert all(r["ok"] and r["rel_err"] < 1e-4 and r["ms"] > 0 for r in kernels), [r for r in kernels if not r["ok"]]
    assert res["compile"][0]["compiles"] == 8 + 4 + len(mg.DECODE_MODES) and res["compile"][0]["failed"] == 0
    for t in ("10", "16"):
        best = res["best"][t]
        assert best["layer"]["ok"] and best["layer"]["ms"] <= best["plan_pick"]["ms"]
        assert best["gate_up"]["kernel"] == "gate_up" and best["down"]["kernel"] == "down"
        assert best["dense_equivalent"]["tokens"] == int(t) and best["fraction_of_dense"] > 0
        assert set(best["parts"]) == {"align_ms", "gate_up_ms", "down_ms", "sum_ms"}
        # the repr is the Plan
        assert eval(best["layer"]["plan"]["repr"], {"Plan": Plan, "Tiles": Tiles}) == mg._plan_from(best["layer"])
    # per size: plan()'s pick and 2 x 2 pairs per row tile, all equal to the reference
    assert len(res["layers"]) == 2 * (1 + 2 * 4) and all(r["ok"] for r in res["layers"])
    assert [r["ok"] for r in res["decode"]] == [True] * len(mg.DECODE_MODES)
    assert len(res["dense_equivalent"]) == 2
    # the printed table, pasted into kernels/moe.py, picks each size's best layer
    space = {"Plan": Plan, "Tiles": Tiles, "math": math, "tuple": tuple, "float": float}
    exec("\n".join(res["plan_table"]), space)
    table = space["PLAN_TABLE"]
    assert table[-1][0] == math.inf and [b for b, _ in table] == sorted(b for b, _ in table)
    for t in (10, 16):
        assert moe.plan(t, 2, 4, table) == mg._plan_from(res["best"][str(t)]["layer"])


def test_plan_table_keeps_small_entries_and_merges():
    """Entries below the smallest size's rows stay; a size's winner reaches halfway (geometric) to
    the next size's rows; neighbours with one Plan become one entry."""
    cfg = mg.Sweep(out=Path(os.devnull))
    a, b = Plan(128, 128, 64, 8, 4, group_m=4, tma=True, fuse_gate_up=True), Plan(128, 128, 64, 8, 3)
    entries = mg.plan_table(cfg, {4096: a, 8192: a, 16384: b})
    small = [e for e in moe.PLAN_TABLE if e[0] < 4096 * 8 / 128]
    assert len(small) == 4
    assert [(bound, p) for bound, p, _ in entries] == [*small, (724, a), (math.inf, b)]
    assert [sizes for *_, sizes in entries] == [[]] * 4 + [[4096, 8192], [16384]]
    assert moe.plan(4096 + 2048, 8, 128, tuple(e[:2] for e in entries)) == a
    assert eval(mg._plan_source(a), {"Plan": Plan, "Tiles": Tiles}) == a
    today = ("Plan(128, 128, 64, 8, 4, group_m=4, tma=True, fuse_gate_up=True, "
             "down=Tiles(256, 64, 8, 4, group_m=4, tma=True, persistent=True))")
    assert mg._plan_source(moe.PLAN_TABLE[-1][1]) == today


def test_gpu_candidates():
    """The lists the GPU run times: 64- and 128-row tiles, TMA, gate and up in one dot (the 2026-11-26
    sweep's winners), power-of-two tiles, the shared memory of the pipeline's stages within an
    H100's (a lower bound: --sm90 compiles them for the real figure), not too many compiles (each
    one program a tile and persistent)."""
    cfg = mg.Sweep(out=Path(os.devnull))
    assert cfg.sizes == (512, 1024, 2048, 4096, 8192, 16384)
    gate_ups, downs = mg.gate_up_candidates(cfg), mg.down_candidates(cfg)
    assert len(gate_ups) + len(downs) <= 48 and len(set(gate_ups)) == len(gate_ups) and len(set(downs)) == len(downs)
    for p in gate_ups + downs:
        assert p.block_m in (64, 128) and p.group_m == mg.FIRST_GROUP and p.tma and p.fuse_gate_up
        for v in (p.block_m, p.block_n, p.block_k, p.down_tiles().block_n, p.down_tiles().block_k):
            assert v & (v - 1) == 0
    for p in gate_ups:
        assert p.num_stages * (p.block_m + 2 * p.block_n) * p.block_k * 2 <= mg.SM90_SHARED
    for p in downs:
        d = p.down_tiles()
        assert d.tma and d.group_m == mg.FIRST_GROUP
        assert d.num_stages * (p.block_m + d.block_n) * d.block_k * 2 <= mg.SM90_SHARED
    # the first phase's candidates include today's plan() at 16,384 tokens (but its program order)
    pick = moe.plan(16384, 8, 128)
    assert dataclasses.replace(pick, group_m=mg.FIRST_GROUP, down=None) in gate_ups
    assert pick.down_tiles() in {p.down_tiles() for p in downs}


def test_candidates_compile_for_h100():
    """Every GPU candidate compiled for sm_90 (`--sm90`): wgmma, TMA where asked, no spills,
    shared memory within an H100's."""
    out = run_outside_interpreter(["-m", "lab.moe_gpu", "--sm90"], timeout=900)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    cfg = mg.Sweep(out=Path(os.devnull))
    assert len(rows) == len(mg.gate_up_candidates(cfg)) + len(mg.down_candidates(cfg))
    for r in rows:
        assert r["fits"] and r["wgmma"] and r["tma"] == (" tma" in r["label"]), r


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
    with pytest.raises(SystemExit) as e:
        mg.main(["--sweep", "--tokens", "4096,lots", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "positive token counts" in capsys.readouterr().err
    assert mg._token_counts("16384,4096,8192,4096") == (4096, 8192, 16384)
