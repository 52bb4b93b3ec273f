"""lab/gluon_decode.py compiles for an H100 on the CPU (Triton's own ptxas, no GPU): the TMA page loads,
both wgmmas, no local memory, the ring within shared memory, for Qwen2.5-0.5B's and SmolLM2-135M's
heads at each plan. Its outputs and times on a GPU are the lab script's (bench/NOTES.md, 2026-11-28)."""
from __future__ import annotations

import pytest

from tests.kernels.util import run_outside_interpreter

pytest.importorskip("triton")

SCRIPT = """
import torch
from tests.kernels import sm90_compile as s
from lab import gluon_decode as gd
bf = torch.bfloat16
for hq, hkv in ((14, 2), (9, 3)):
    q = torch.zeros(64, hq, 64, dtype=bf)
    kc = torch.zeros(4096, hkv, 16, 64, dtype=bf)
    bt, sl = torch.zeros(64, 2048, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    for bn, st in gd.PLANS:
        grid, args, kw = gd.launch_args(q, kc, kc.clone(), bt, sl, 0.125, torch.empty_like(q), bn, st)
        c = s.compile_sm90(gd._gluon_decode_kernel, args, kw)
        ptx = c.asm["ptx"]
        print("plan", c.metadata.shared, s.sass_stats(c)["local"], "cp.async.bulk.tensor" in ptx,
              ptx.count("wgmma.mma_async") >= 2, grid == (64, hkv))
"""


def test_kernel_compiles_for_sm90():
    from lab import gluon_decode
    if gluon_decode.gluon is None:
        pytest.skip("this Triton has no Gluon")
    out = run_outside_interpreter(["-c", SCRIPT], timeout=600)
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("plan")]
    assert len(rows) == 2 * len(gluon_decode.PLANS)
    for shared, local, tma, wgmma, grid in rows:
        assert int(shared) <= 227 * 1024 and local == "0" and [tma, wgmma, grid] == ["True"] * 3, rows


def test_plans_refuse_the_tile_that_computed_wrong():
    import torch

    from lab import gluon_decode
    if gluon_decode.gluon is None:
        pytest.skip("this Triton has no Gluon")
    q = torch.zeros(4, 14, 64, dtype=torch.bfloat16)
    kc = torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        gluon_decode.launch_args(q, kc, kc, torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
                                 0.125, torch.empty_like(q), block_n=64, stages=8)
