import pytest
import torch

from kernels import launch
from kernels.argmax import argmax_rows
from tests.kernels.util import DEVICE, gpu


def _rows(N, V, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, V, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N,V", [(1, 64), (3, 1000), (5, 257)])
def test_argmax_rows(dtype, N, V):
    x = _rows(N, V, dtype, seed=V)
    assert torch.equal(argmax_rows(x, chunk=64), torch.argmax(x, dim=-1))


def test_argmax_ties_and_infinities():
    """The first index of the max wins, within a chunk and across chunks; a row of -inf gives 0."""
    x = _rows(4, 300, torch.bfloat16)
    x[0, [7, 9, 250]] = 40.0  # same chunk first, then a later chunk
    x[1, [200, 290]] = 40.0  # two later chunks
    x[2] = float("-inf")
    x[3, 299] = float("inf")
    out = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(x, out, chunk=64) is out
    assert out.tolist() == [7, 200, 0, 299] == torch.argmax(x, dim=-1).tolist()
    assert all(not c.any() for c in launch._COUNTERS[x.device])  # counters back at zero


def test_argmax_nan_is_largest():
    """As torch.argmax: the first NaN of a row wins over any value, inf included."""
    x = _rows(3, 300, torch.float32)
    x[0, [100, 280]] = float("nan")
    x[0, 5] = float("inf")
    x[1, 299] = float("nan")
    assert argmax_rows(x, chunk=64).tolist() == [100, 299, int(torch.argmax(x[2]))] == torch.argmax(x, dim=-1).tolist()


def test_argmax_no_rows():
    assert argmax_rows(_rows(0, 100, torch.float32)).shape == (0,)


@gpu
@pytest.mark.parametrize("N", [1, 64, 256])
def test_argmax_real_vocab(N):
    x = _rows(N, 151936, torch.bfloat16, seed=N)
    x[0, [5, 150000]] = x[0].max() + 1  # a tie across the row's first and last chunk
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


@gpu
def test_argmax_in_a_cuda_graph():
    x = _rows(64, 151936, torch.bfloat16)
    out = torch.empty(64, dtype=torch.int64, device=DEVICE)
    argmax_rows(x, out)  # counters and compile before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        argmax_rows(x, out)
    for seed in range(3):
        x.copy_(_rows(64, 151936, torch.bfloat16, seed=seed + 1))
        g.replay()
        assert torch.equal(out, torch.argmax(x, dim=-1))
