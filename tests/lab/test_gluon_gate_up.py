"""lab/gluon_gate_up.py compiles for an H100 on the CPU (Triton's own ptxas, no GPU): Qwen2.5-0.5B's and
SmolLM2-135M's decode gate/up, plain and warp-specialized, x resident and the weight ring within shared
memory, wgmma, no spills.
Its results against the reference are checked by the lab script on a GPU (bitwise equal, 2026-11-27)."""
from __future__ import annotations

import pytest

from tests.kernels.util import run_outside_interpreter

pytest.importorskip("triton")

SCRIPT = """
import torch
from tests.kernels import sm90_compile as s
from lab import gluon_gate_up as gg
for M, K, I, unit, stages in ((64, 896, 4864, 16, 4), (16, 576, 1536, 32, 4)):
    x, w = torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(2 * I, K, dtype=torch.bfloat16)
    grid, args, kw = gg.launch_args(x, w, torch.empty(M, I, dtype=torch.bfloat16), 132, unit, stages)
    for kernel in (gg._gate_up_kernel, gg._ws_gate_up_kernel):
        c = s.compile_sm90(kernel, args, kw)
        ptx = c.asm["ptx"]
        print(grid[0], c.metadata.shared, s.sass_stats(c)["local"], "wgmma" in ptx, "cp.async.bulk.tensor" in ptx)
"""


def test_gluon_gate_up_compiles_for_sm90():
    from lab import gluon_gate_up
    if gluon_gate_up.gluon is None:
        pytest.skip("this Triton has no Gluon")
    out = run_outside_interpreter(["-c", SCRIPT], timeout=600)
    rows = [line.split() for line in out.splitlines() if line and line[0].isdigit()]
    assert len(rows) == 4  # two shapes, each plain and warp-specialized
    assert [r[0] for r in rows] == ["132", "132", "48", "48"]  # one program an SM, or a unit each where fewer
    for programs, shared, local, wgmma, tma in rows:
        assert int(shared) <= 227 * 1024 and local == "0", rows
        assert wgmma == "True" and tma == "True", rows
