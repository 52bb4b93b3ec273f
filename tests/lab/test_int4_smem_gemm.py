"""lab/int4_smem_gemm.py: its plans, its kernel compiled for an H100 on the CPU (Triton's own ptxas, no
GPU: both tiles, K whole and split, groups of 128 with bias and of 32 in float16, the probes), and on
a Hopper GPU its output against reference.int4_linear."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.util import HAS_CUDA, gpu, run_outside_interpreter

pytest.importorskip("triton")


def test_plans():
    from lab.int4_smem_gemm import Plan, plan
    assert plan(2048, 28672, 4096, 132) == Plan(256, 2, 1)  # 1,792 tiles: K whole
    assert plan(150, 28672, 4096, 132) == Plan(128, 3, 1)  # fewer rows: the 128-row tile
    assert plan(512, 4096, 14336, 132).split == 2  # 64 tiles: one wave of 128 programs
    assert plan(512, 1152, 896, 132).split == 1  # seven K steps: never split below eight a program


SCRIPT = """
import torch
from tests.kernels import sm90_compile as s
from lab import int4_smem_gemm as g
bf, f16 = torch.bfloat16, torch.float16
w = torch.randint(-2**31, 2**31 - 1, (1152, 128), dtype=torch.int32)
cases = ((8, bf, g.Plan(256, 2), 0), (32, f16, g.Plan(128, 3, 2), 0), (8, bf, g.Plan(256, 2), 3))
for groups, dtype, p, probe in cases:
    x = torch.zeros(300, 1024, dtype=dtype)
    grid, args, kw = g.launch_args(x, w, torch.ones(groups, 1152, dtype=f16),
                                   torch.full((groups, 1152), 8, dtype=torch.uint8), 1024 // groups,
                                   torch.ones(1152, dtype=dtype) if groups == 8 else None,
                                   torch.empty(300, 1152, dtype=dtype), p, True, probe)
    c = s.compile_sm90(g._w4a16_gemm_kernel, args, kw)
    ptx = c.asm["ptx"]
    print("gemm", c.metadata.shared, s.sass_stats(c)["local"], ptx.count("wgmma.mma_async") > 0, "cp.async" in ptx,
          "griddepcontrol.wait" in ptx)
"""


def test_kernel_compiles_for_sm90():
    from lab import int4_smem_gemm
    if int4_smem_gemm.gluon is None:
        pytest.skip("this Triton has no Gluon")
    out = run_outside_interpreter(["-c", SCRIPT], timeout=900)
    rows = [line.split() for line in out.splitlines() if line.startswith("gemm")]
    assert len(rows) == 3, out
    for _, shared, local, wgmma, cp_async, wait in rows:
        assert int(shared) <= 227 * 1024 and local == "0" and wgmma == cp_async == wait == "True", rows


def hopper_case(group: int, M: int, dtype: torch.dtype) -> tuple:
    """x [M, 1152] (nine 128-column blocks), a 4-bit [200, 1152] weight (a partial tile) with free zero
    points 0-16, a bias, and the group, on the GPU."""
    from engine.int4 import quantize
    from kernels import int4
    N, K = 200, 1152
    gen = torch.Generator().manual_seed(M)
    w, s, z = [t.cuda() for t in quantize(torch.randn(N, K, generator=gen) / K ** 0.5, group)]
    z = torch.randint(0, 17, z.shape, generator=gen, dtype=torch.uint8).cuda()
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    b = torch.randn(N, generator=gen).to(dtype).cuda()
    return x, w, s, z, b, int4.group_of(w, s, z)


@gpu
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("M", [1, 130, 257, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_against_the_reference(group, M, dtype):
    """Both tiles, K whole or split in two or three (nine blocks: odd counts for the buffer rings),
    row and column tails, free zero points 0-16, bias or none."""
    from kernels import reference as ref
    from lab import int4_smem_gemm as g
    from tests.kernels.test_int4 import _close
    if not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0) or g.gluon is None:
        pytest.skip("Hopper's Gluon kernel")
    x, w, s, z, b, G = hopper_case(group, M, dtype)
    assert g.supports(x, x.shape[1], G)
    for bias in (b, None):
        want = ref.int4_linear(x, w, s, z, bias)
        for p in (g.Plan(128, 3), g.Plan(256, 2), g.Plan(256, 2, 2), g.Plan(128, 3, 3)):
            _close(g.w4a16_gemm(x, w, s, z, G, bias, p=p), want, ulps=2)
