"""lab/persistent_mlp.py under Triton's interpreter (its two phases as two launches) and, on a GPU,
with the grid barrier: the MLP block against a float64 one and the engine's reference ops."""
import pytest
import torch

pytest.importorskip("triton")

from lab import persistent_mlp as fm  # noqa: E402
from tests.kernels.util import DEVICE, HAS_CUDA, gpu, rel_err  # noqa: E402


def _inputs(M, H, I, dtype=torch.bfloat16, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(dtype).to(device)
    r = torch.randn(M, H, generator=g).to(dtype).to(device)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(device)
    wgu = (torch.randn(2 * I, H, generator=g) / H ** 0.5).to(dtype).to(device)
    wd = (torch.randn(H, I, generator=g) / I ** 0.5).to(dtype).to(device)
    return x, r, nw, wgu, wd


def _exact(x, r, nw, wgu, wd):
    h = (x.double() + r.double()).to(x.dtype).double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    gate, up = (h @ wgu.double().t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ wd.double().t()


def _check(M, H, I, p=None, dtype=torch.bfloat16, seed=0):
    x, r, nw, wgu, wd = _inputs(M, H, I, dtype, seed)
    out, res = fm.fused_mlp(x, r, nw, 1e-6, wgu, wd, p)
    ref_out, ref_res = fm.reference_mlp(x, r, nw, 1e-6, wgu, wd)
    if HAS_CUDA:
        assert torch.equal(res, ref_res)  # the residual sum is rounded as the reference rounds it
    else:  # the interpreter's float32 -> bfloat16 cast truncates: one unit in the last place
        torch.testing.assert_close(res, ref_res, atol=0, rtol=2 ** -7)
    assert out.shape == ref_out.shape and out.dtype == x.dtype
    assert rel_err(out, _exact(x, r, nw, wgu, wd)) < (1e-2 if HAS_CUDA else 3e-2)  # CPU: truncating casts
    if HAS_CUDA:  # the reference rounds the normed x before its matmul, the kernel scales after
        assert rel_err(out, ref_out) < 1e-2
    return out


@pytest.mark.parametrize("M,H,I", [(1, 64, 64), (5, 128, 96), (16, 192, 200), (37, 64, 320)])
def test_fused_mlp_matches_reference(M, H, I):
    """Rows below the tile, a hidden size that is not a multiple of the K tile (192), gate columns
    that do not split evenly over the programs (200, 320), several K splits in phase B."""
    _check(M, H, I, seed=M)


def test_fused_mlp_splits_and_float16():
    p = fm.plan(8, 128, 256, 4)
    assert p.splits == 2  # two column tiles of 64, two K splits each
    _check(8, 128, 256, p, torch.float16, seed=3)
    counters = fm.arrival_counters(torch.device(DEVICE), 4)
    assert int(counters[:4].abs().sum()) == 0  # left at zero for the next launch


def test_plan_spreads_columns():
    p = fm.plan(64, 896, 4864, 132)  # Qwen2.5-0.5B on an H100
    assert p.block_n == 64 and p.block_k == 128  # 37 gate columns a program
    assert p.d_block_n == 64 and p.splits == 9  # 14 column tiles x 9 K splits = 126 programs
    p = fm.plan(64, 8192, 64, 4)
    assert p.d_block_n == 2048 and p.splits == 1


def test_supports():
    x, r, nw, wgu, wd = _inputs(4, 64, 64)
    assert fm.supports(x, r, wgu, wd)
    assert not fm.supports(x.float(), r.float(), wgu.float(), wd.float())
    assert not fm.supports(torch.cat([x] * 17), torch.cat([r] * 17), wgu, wd)  # 68 rows: not a decode step
    assert not fm.supports(x, r, wgu, wd.t().contiguous().t())


@gpu
@pytest.mark.parametrize("M", [1, 33, 64])
def test_fused_mlp_gpu_real_shapes(M):
    """Qwen2.5-0.5B's and SmolLM2-135M's MLPs with the grid barrier, twice (the counters reset)."""
    for H, I in ((896, 4864), (576, 1536)):
        first = _check(M, H, I, seed=M)
        assert torch.equal(first, _check(M, H, I, seed=M))  # deterministic: split order, not timing
