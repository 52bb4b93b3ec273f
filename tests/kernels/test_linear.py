import pytest
import torch

from kernels import launch
from kernels import linear as lin
from kernels import reference as ref
from tests.kernels.util import DEVICE, gpu

# bf16/fp16 outputs: within a couple of units in the last place of the float64 product
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _check(got: torch.Tensor, expect64: torch.Tensor) -> None:
    tol = TOL[got.dtype]
    torch.testing.assert_close(got.double(), expect64, atol=tol * expect64.abs().max().item(), rtol=tol)


def _inputs(M, N, K, dtype, bias, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _expect(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


PLANS = [lin.Plan(16, 64, 1, swap=False), lin.Plan(32, 64, 2, swap=True), lin.Plan(16, 64, 3, swap=False),
         lin.Plan(64, 128, 2, swap=False)]


@pytest.mark.parametrize("plan", PLANS, ids=str)
@pytest.mark.parametrize("M", [1, 5, 16, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear(plan, M, bias):
    x, w, b = _inputs(M, 40, 256, torch.bfloat16, bias, seed=M)
    _check(lin.skinny_linear(x, w, b, p=plan), _expect(x, w, b))


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[1]], ids=str)
def test_skinny_linear_float16(plan):
    x, w, b = _inputs(7, 24, 192, torch.float16, True, seed=3)
    _check(lin.skinny_linear(x, w, b, p=plan), _expect(x, w, b))


def test_split_counters_reset_between_launches():
    """The split-K counters must be back at zero after every launch, or the next one merges early."""
    p = lin.Plan(16, 64, 4, swap=False)
    for seed in range(3):
        x, w, b = _inputs(9, 48, 256, torch.bfloat16, True, seed=seed)
        _check(lin.skinny_linear(x, w, b, p=p), _expect(x, w, b))
        assert all(not c.any() for c in launch._COUNTERS[x.device])


def test_plan_from_shapes():
    assert lin.plan(64, 1152, 896) == lin.Plan(16, 128, 1, swap=False)  # 7 K steps: no split
    assert lin.plan(64, 896, 4864) == lin.Plan(32, 128, 4, swap=False)  # 38 K steps: 4 splits
    assert lin.plan(8, 896, 4864).swap


def test_dispatch_falls_back_where_unsupported():
    """float32, more than 64 rows, and large weights go to torch, with identical results."""
    for M, N, K, dtype in [(4, 24, 64, torch.float32), (65, 24, 64, torch.bfloat16)]:
        x, w, b = _inputs(M, N, K, dtype, True)
        assert not lin.supports(x, w)
        assert torch.equal(lin.linear(x, w, b), ref.linear(x, w, b))
    big = torch.empty(lin.MAX_WEIGHT_BYTES // 2 // 64 + 1, 64, dtype=torch.bfloat16)
    assert not lin.supports(torch.empty(1, 64, dtype=torch.bfloat16), big)


def test_large_weights_over_a_long_k_take_their_own_tiles():
    """An MLP's down projection past MAX_WEIGHT_BYTES (Llama-3-8B's: 4,096 x 14,336) keeps the skinny
    kernel, in LONG_K_PLAN's tiles; a square or wide one of the same size goes to cuBLAS, and so does
    Llama-3-70B's down at TP=2 (8,192 x 14,336), which cuBLAS streams at 95% of the bandwidth."""
    x = torch.empty(64, 14336, dtype=torch.bfloat16)
    assert lin.supports(x, torch.empty(4096, 14336, dtype=torch.bfloat16)) == lin.LONG_K_PLAN
    assert lin.supports(x, torch.empty(8192, 14336, dtype=torch.bfloat16)) is None
    assert lin.supports(x[:, :4096], torch.empty(14336, 4096, dtype=torch.bfloat16)) is None
    assert lin.supports(x[:, :8192], torch.empty(8192, 8192, dtype=torch.bfloat16)) is None
    x, w, b = _inputs(5, 64, 512, torch.bfloat16, True)  # the plan at a size the interpreter runs
    _check(lin.skinny_linear(x, w, b, p=lin.LONG_K_PLAN), _expect(x, w, b))


def test_dispatch_writes_into_out():
    x, w, b = _inputs(3, 40, 128, torch.bfloat16, True)
    out = torch.empty(8, 40, dtype=torch.bfloat16, device=DEVICE)[:3]
    assert lin.linear(x, w, b, out=out) is out
    _check(out, _expect(x, w, b))


# Qwen2.5-0.5B's projections (qkv with bias, o, down) at the decode graphs' batch sizes
QWEN = [(1152, 896, True), (896, 896, False), (896, 4864, False)]


@gpu
@pytest.mark.parametrize("N,K,bias", QWEN)
@pytest.mark.parametrize("M", [1, 3, 8, 16, 24, 40, 64])
def test_skinny_linear_gpu(N, K, bias, M):
    x, w, b = _inputs(M, N, K, torch.bfloat16, bias, seed=M)
    assert lin.supports(x, w)
    _check(lin.skinny_linear(x, w, b), _expect(x, w, b))


@gpu
@pytest.mark.parametrize("N,K", [(4096, 14336), (4096, 7168)])  # Llama-3-8B's down at TP=1, TP=2
@pytest.mark.parametrize("M", [1, 16, 64])
def test_long_k_linear_gpu(N, K, M):
    x, w, _ = _inputs(M, N, K, torch.bfloat16, False, seed=M)
    assert lin.supports(x, w) == lin.LONG_K_PLAN
    _check(lin.linear(x, w, pdl=True), _expect(x, w, None))


@gpu
def test_skinny_linear_gpu_graph_replays():
    """Split-K in a CUDA graph, replayed many times on new inputs: a race in the last-arriving
    merge or a counter left non-zero shows up as a wrong result."""
    M, N, K = 64, 896, 4864
    x, w, _ = _inputs(M, N, K, torch.bfloat16, False)
    assert lin.plan(M, N, K).split > 1
    lin.skinny_linear(x, w)  # warm-up: compiles, allocates the counters
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        lin.skinny_linear(x, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lin.skinny_linear(x, w)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        g.replay()
        torch.cuda.synchronize()
        _check(out, _expect(x, w, None))
