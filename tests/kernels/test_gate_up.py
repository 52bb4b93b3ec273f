import pytest
import torch

from kernels import gate_up as gu
from kernels import reference as ref
from tests.kernels.util import DEVICE, gpu

# 16-bit outputs: gate and up are rounded to the dtype before the SiLU (as the unfused GEMM's
# output is), so a few units in the last place against the float64 result
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _inputs(M, I, K, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * I, K, generator=g) / K ** 0.5).to(dtype).to(device)
    return x, w


def _expect(x, w):
    y = x.double() @ w.double().t()
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _check(got, x, w):
    expect = _expect(x, w)
    tol = TOL[got.dtype]
    assert got.shape == expect.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), expect, atol=tol * expect.abs().max().item(), rtol=tol)


PLANS = [gu.Plan(16, 16, 32, 4, 2, 2), gu.Plan(32, 32, 64, 4, 3, 8), gu.Plan(16, 64, 128, 4, 3, 1)]


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("M,I,K", [(1, 40, 64), (37, 48, 96), (70, 24, 200)])
def test_gate_up_silu(plan, M, I, K):
    """Odd rows, columns past the last tile (gate tiles that run into the up rows), K not a
    multiple of the K tile (TMA's zero fill)."""
    x, w = _inputs(M, I, K, torch.bfloat16, seed=M)
    _check(gu.gate_up_silu(x, w, plan), x, w)


def test_gate_up_silu_float16():
    x, w = _inputs(19, 32, 128, torch.float16, seed=5)
    _check(gu.gate_up_silu(x, w, PLANS[1]), x, w)


def test_gate_up_silu_empty():
    x, w = _inputs(0, 16, 64, torch.bfloat16)
    assert gu.gate_up_silu(x, w, PLANS[0]).shape == (0, 16)


def test_plan_from_shapes():
    assert gu.plan(64, 4864, 896) == gu.Plan(64, 32, 128, 4, 3)
    assert gu.plan(5, 4864, 896) == gu.Plan(16, 32, 128, 4, 3)
    assert gu.plan(512, 4864, 896) is None  # measured slower than cuBLAS + the SiLU kernel
    assert gu.plan(1024, 4864, 896) == gu.Plan(128, 64, 64, 8, 3, 16)
    assert gu.plan(1024, 14336, 4096) is None
    assert gu.plan(8192, 14336, 4096) == gu.Plan(128, 128, 64, 8, 3, 16)


@pytest.mark.parametrize("M", [3, 100])  # the fused kernel, the unfused path
def test_mlp_gate_up_matches_reference(M):
    x, w = _inputs(M, 40, 64, torch.bfloat16, seed=M)
    assert (gu.plan(M, 40, 64) is None) == (M == 100)
    _check(gu.mlp_gate_up(x, w), x, w)
    _check(ref.gate_up_silu(x, w), x, w)


def test_mlp_gate_up_falls_back():
    """float32, and rows whose stride TMA cannot take, go through the unfused path."""
    x, w = _inputs(4, 24, 64, torch.float32)
    assert not gu.supports(x, w)
    torch.testing.assert_close(gu.mlp_gate_up(x, w), ref.gate_up_silu(x, w), atol=1e-5, rtol=1e-5)
    xb, wb = _inputs(4, 24, 68, torch.bfloat16)
    xs = torch.zeros(4, 70, dtype=torch.bfloat16, device=DEVICE)[:, :68]
    xs.copy_(xb)  # row stride 140 bytes
    assert not gu.supports(xs, wb)
    _check(gu.mlp_gate_up(xs, wb), xb, wb)
    with pytest.raises(AssertionError, match="gate_up_silu needs"):
        gu.gate_up_silu(xs, wb)


@gpu
@pytest.mark.parametrize("model,K,I", [("qwen2.5-0.5b", 896, 4864), ("llama3-8b", 4096, 14336),
                                       ("llama3-8b at TP=2", 4096, 7168)])
@pytest.mark.parametrize("M", [1, 64, 1024, 3328])
@pytest.mark.parametrize("pdl", [False, True])  # the unfused path's kernels; with prefetch the fused one's too
def test_gate_up_real_shapes(model, K, I, M, pdl):
    x, w = _inputs(M, I, K, torch.bfloat16, seed=M)
    _check(gu.mlp_gate_up(x, w, pdl=pdl), x, w)
    _check(gu.mlp_gate_up(x, w, pdl=pdl, prefetch=True), x, w)
    p = gu.plan(M, I, K) or gu.Plan(128, 64, 64, 8, 3, 16)
    _check(gu.gate_up_silu(x, w, p), x, w)
