import pytest
import torch

from kernels import launch
from kernels import reference
from kernels.argmax import argmax_keys, argmax_rows, key_token
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


def _split_argmax(x: torch.Tensor, parts: int, keys_fn) -> torch.Tensor:
    """The argmax of x's rows from the largest of its column ranges' keys (as tensor-parallel ranks)."""
    V = x.shape[1]
    per = -(-V // parts)
    keys = [keys_fn(x[:, r * per:min(V, (r + 1) * per)], r * per) for r in range(parts)]
    return key_token(torch.stack(keys).amax(dim=0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_keys_over_vocabulary_ranges_give_the_argmax_of_the_whole_row(dtype, parts):
    """Ties across ranges (the lower index wins), -0.0 against 0.0 (equal: the first), NaN above
    inf, all -inf, negatives only: the largest key is the whole row's torch.argmax, and the kernel's
    keys are the reference's."""
    x = _rows(9, 300, dtype, seed=parts)
    x[0, [250, 20]] = 40.0  # a tie across ranges
    x[1] = -x[1].abs() - 1  # negatives only
    x[2] = -1.0
    x[2, 10] = -0.0  # equal to the 0.0 after it: the first wins
    x[2, 290] = 0.0
    x[3] = float("-inf")
    x[4, 5] = float("inf")
    x[4, 280] = float("nan")
    x[5, [290, 120]] = float("nan")
    x[6, 299] = 1e4
    x[7] = x[7] * 1e-30  # tiny values
    x[8, 150:] = 99.0
    want = torch.argmax(x, dim=-1)
    got = _split_argmax(x, parts, lambda part, off: argmax_keys(part, off, chunk=64))
    assert got.tolist() == want.tolist()
    assert _split_argmax(x, parts, reference.argmax_keys).tolist() == want.tolist()
    for off in (0, 1000):
        assert torch.equal(argmax_keys(x, off, chunk=64), reference.argmax_keys(x, off))


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
