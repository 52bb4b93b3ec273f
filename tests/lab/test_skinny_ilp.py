"""lab/skinny_ilp.py's matmul (the skinny kernel with 1, 2 or 4 accumulator chains) against torch under
Triton's interpreter, with a K split and a last K tile shorter than the chains' stride. Its speed is the lab
script's business (H100, 2026-11-27: no faster than kernels/linear.py at its 4 stages)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.parametrize("chains", [1, 2, 4])
@pytest.mark.parametrize("M,K,N,split", [(40, 640, 96, 1), (16, 1024, 64, 2)])
def test_ilp_linear_matches_torch(chains, M, K, N, split):
    from kernels import linear as lin
    from lab.skinny_ilp import ilp_linear

    g = torch.Generator().manual_seed(M + K)
    x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    out = ilp_linear(x, w, b, lin.Plan(32, 128, split, swap=False), chains)
    ref = (x.float() @ w.float().T + b.float()).bfloat16()
    torch.testing.assert_close(out.float(), ref.float(), atol=0.5, rtol=1e-2)
