"""lab/int4_ws_gemm.py: the warp-specialized W4A16 GEMM compiled for an H100 on the CPU (Triton's own
ptxas, no GPU: both tiles, groups of 128 with bias and of 32 in float16; three partitions with their
register counts, TMA, wgmma, no spills), and on a Hopper GPU its output against reference.int4_linear."""
from __future__ import annotations

import re

import pytest
import torch

from tests.kernels.util import HAS_CUDA, gpu, run_outside_interpreter

pytest.importorskip("triton")

SCRIPT = """
import re
import torch
from tests.kernels import sm90_compile as s
from lab import int4_ws_gemm as g
bf, f16 = torch.bfloat16, torch.float16
w = torch.randint(-2**31, 2**31 - 1, (1152, 128), dtype=torch.int32)
for groups, dtype, bm in ((8, bf, 256), (32, f16, 128)):
    x = torch.zeros(300, 1024, dtype=dtype)
    grid, args, kw = g.launch_args(x, w, torch.ones(groups, 1152, dtype=f16),
                                   torch.full((groups, 1152), 8, dtype=torch.uint8), 1024 // groups,
                                   torch.ones(1152, dtype=dtype) if groups == 8 else None,
                                   torch.empty(300, 1152, dtype=dtype), bm)
    c = s.compile_sm90(g._w4a16_ws_kernel, args, kw)
    ptx = c.asm["ptx"]
    regs = sorted({int(r) for r in re.findall(r"setmaxnreg\\.inc\\.sync\\.aligned\\.u32\\s+(\\d+);", ptx)})
    print("ws", c.metadata.shared, s.sass_stats(c)["local"], "wgmma.mma_async" in ptx, "cp.async.bulk.tensor" in ptx,
          ",".join(map(str, regs)))
"""


def test_kernel_compiles_for_sm90():
    from lab import int4_ws_gemm
    if int4_ws_gemm.gluon is None:
        pytest.skip("this Triton has no Gluon")
    out = run_outside_interpreter(["-c", SCRIPT], timeout=900)
    rows = [line.split() for line in out.splitlines() if line.startswith("ws")]
    assert len(rows) == 2, out
    for _, shared, local, wgmma, tma, regs in rows:
        assert int(shared) <= 227 * 1024 and local == "0" and wgmma == tma == "True", rows
        assert {176, 152} <= {int(r) for r in re.findall(r"\d+", regs)}, rows  # the partitions' registers


@gpu
@pytest.mark.parametrize("group, M, dtype, block_m", [(128, 300, torch.bfloat16, 256), (32, 130, torch.float16, 128),
                                                      (-1, 600, torch.bfloat16, 128), (64, 7, torch.bfloat16, 256)])
def test_against_the_reference(group, M, dtype, block_m):
    """Row and column tails, K of nine blocks (18 stages through a ring of 4 or 6), free zero points
    0-16, bias or none."""
    from kernels import reference as ref
    from lab import int4_ws_gemm as g
    from tests.kernels.test_int4 import _close
    from tests.lab.test_int4_smem_gemm import hopper_case
    if not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0) or g.gluon is None:
        pytest.skip("Hopper's Gluon kernel")
    x, w, s, z, b, G = hopper_case(group, M, dtype)
    assert g.supports(x, x.shape[1], G)
    for bias in (b, None):
        _close(g.w4a16_gemm(x, w, s, z, G, bias, block_m=block_m), ref.int4_linear(x, w, s, z, bias), ulps=2)
