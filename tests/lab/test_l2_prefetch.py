"""lab/l2_prefetch.py's kernel compiles for an H100 on the CPU (Triton's own ptxas): bulk L2
prefetches issued before the PDL wait, no load or store of its own. What it does to a decode step
is the lab script's to measure (H100, 2026-11-28: every variant slower; bench/NOTES.md)."""
from __future__ import annotations

import pytest

from tests.kernels.util import run_outside_interpreter

pytest.importorskip("triton")

SCRIPT = """
import torch
from tests.kernels import sm90_compile as s
from lab import l2_prefetch as p
calls = []
p.launch = lambda fn, grid, *a, **k: calls.append((fn, grid, a, k))
p.l2_prefetch(torch.empty(896, 896, dtype=torch.bfloat16), torch.empty(9728, 896, dtype=torch.bfloat16))
p.l2_prefetch(torch.empty(896, 4864, dtype=torch.bfloat16))
for fn, grid, a, k in calls:
    ptx = s.compile_sm90(fn, a, k).asm["ptx"]
    wait, bulk = ptx.find("griddepcontrol.wait"), ptx.find("cp.async.bulk.prefetch.L2.global")
    print("prefetch", grid[0], 0 <= bulk < wait, "ld.global" in ptx or "st.global" in ptx, "launch_dependents" in ptx)
"""


def test_prefetch_kernel_compiles_for_sm90():
    out = run_outside_interpreter(["-c", SCRIPT], timeout=600)
    rows = [line.split() for line in out.splitlines() if line.startswith("prefetch")]
    assert rows == [["prefetch", "4", "True", "False", "True"]] * 2
