"""lab/splitk_gemm.py under Triton's interpreter at tiny shapes: every split count and a ragged M and
N equal a float32 matmul of the same bf16 inputs (to bf16 rounding), the tile counters back at zero."""
from __future__ import annotations

import pytest
import torch

from kernels import launch
from lab import splitk_gemm


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("M,N", [(16, 32), (40, 48)])
def test_split_k_matmul_equals_torch(split, M, N):
    g = torch.Generator().manual_seed(M * split)
    x = torch.randn(M, 96, generator=g).bfloat16()
    w = torch.randn(N, 96, generator=g).bfloat16()
    got = splitk_gemm.matmul(x, w, (16, 16, 32, split, 2, 4))
    want = (x.float() @ w.float().T).bfloat16()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert all(not c.any() for c in launch._COUNTERS[x.device])


def test_a_split_without_k_is_refused():
    x, w = torch.zeros(16, 64).bfloat16(), torch.zeros(16, 64).bfloat16()
    with pytest.raises(AssertionError, match="every split needs K"):
        splitk_gemm.matmul(x, w, (16, 16, 32, 3, 2, 4))
