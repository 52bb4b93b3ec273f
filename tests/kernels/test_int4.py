"""kernels/int4.py against reference.int4_linear: 4-bit weights in groups of 32-128 columns and one
group a row, few rows (K split over programs, the weight as the wide MMA operand) and many, with
and without bias; the dequantization kernel against reference.dequantize_int4. On a GPU, Hopper's
kernel (kernels/int4_wgmma.py) the same way, and this module's kernel beside it."""
import pytest
import torch

from engine.int4 import quantize
from kernels import int4, int4_wgmma
from kernels import reference as ref
from tests.kernels.util import DEVICE, HAS_CUDA, gpu


def _weight(N, K, group, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return [t.to(device) for t in quantize(torch.randn(N, K, generator=g) / K ** 0.5, group)]


def _close(got, want, ulps: int = 1):
    tol = ulps * {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -20}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("M", [1, 16, 40, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_matmul(group, M, dtype):
    N, K = 200, 512  # a partial column tile; K split over programs for few rows
    w, s, z = _weight(N, K, group, seed=M)
    g = torch.Generator().manual_seed(M + 1)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE)
    for bias in (None, b):
        ulps = 1 if dtype != torch.float32 else 8
        _close(int4.w4a16_matmul(x, w, s, z, bias), ref.int4_linear(x, w, s, z, bias), ulps=ulps)


def test_zero_points_and_scales_are_per_row_and_group():
    """Distinct zero points a group (0 and 15 included) move exactly their columns."""
    w, s, z = _weight(64, 256, 64, seed=5)
    z = torch.randint(0, 16, z.shape, generator=torch.Generator().manual_seed(6), dtype=torch.uint8).to(DEVICE)
    x = torch.randn(3, 256).to(DEVICE)
    _close(int4.w4a16_matmul(x, w, s, z), ref.int4_linear(x, w, s, z), ulps=8)


def test_int4_linear_into_out():
    w, s, z = _weight(96, 256, 128, seed=3)
    x = torch.randn(5, 256).to(torch.bfloat16).to(DEVICE)
    out = torch.empty(5, 96, dtype=torch.bfloat16, device=DEVICE)
    assert int4.int4_linear(x, w, s, z, out=out) is out
    _close(out, ref.int4_linear(x, w, s, z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(80, 384, 128), (48, 640, 32), (24, 96, -1)])
def test_dequantize(dtype, n, k, group):
    # 640 columns: five 128-column blocks, the second program's last three masked; 96: 32-column blocks
    w, s, z = _weight(n, k, group, seed=7)
    # one rounding to dtype (which Triton's CPU interpreter truncates: within one unit)
    _close(int4.dequantize(w, s, z, dtype), ref.dequantize_int4(w, s, z).to(dtype), ulps=1)


def test_gate_up_silu():
    w, s, z = _weight(2 * 128, 256, 64, seed=4)
    x = torch.randn(6, 256).to(torch.bfloat16).to(DEVICE)
    _close(int4.int4_gate_up_silu(x, w, s, z), ref.int4_gate_up_silu(x, w, s, z), ulps=4)


@pytest.mark.parametrize("M", [3, 70])
def test_columns_in_activation_order(M):
    """order: the weight's columns are x's in this order (x gathered first, exactly)."""
    w, s, z = _weight(96, 256, 64, seed=M)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    order = torch.randperm(256, generator=g).to(DEVICE)
    assert torch.equal(int4.gather_columns(x, order), x[:, order])
    want = ref.int4_linear(x[:, order].contiguous(), w, s, z)
    assert torch.equal(ref.int4_linear(x, w, s, z, order=order), want)
    _close(int4.int4_linear(x, w, s, z, order=order), want)
    _close(int4.int4_gate_up_silu(x, w, s, z, order=order), ref.int4_gate_up_silu(x, w, s, z, order=order), ulps=4)


def test_columns_padded_with_zeros():
    """An order longer than x's columns, -1 for a column of zeros (a rank's act-order o projection
    under tensor parallelism: every group, this rank's columns in it, zeros for the rest)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    order = torch.randint(-1, 96, (256,), generator=g).to(DEVICE)
    want = torch.cat([x, x.new_zeros(5, 1)], dim=1)[:, torch.where(order < 0, 96, order)]
    assert torch.equal(int4.gather_columns(x, order), want)
    assert torch.equal(ref.gather_columns(x, order), want)
    w, s, z = _weight(64, 256, 64, seed=6)
    _close(int4.int4_linear(x, w, s, z, order=order), ref.int4_linear(want, w, s, z))


@gpu
@pytest.mark.parametrize("M", [1, 64, 256, 512, 2048])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (28672, 4096), (1152, 896)])
def test_int4_linear_real_shapes(M, shape):
    """Llama-3-8B's and Qwen2.5-0.5B's projections on the GPU, through both paths (W4A16 GEMM,
    dequantization + cuBLAS)."""
    N, K = shape
    w, s, z = _weight(N, K, 128, seed=M, device="cuda")
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    _close(int4.int4_linear(x, w, s, z), ref.int4_linear(x, w, s, z), ulps=2)


@gpu
@pytest.mark.parametrize("M", [1, 64, 512])
def test_int4_linear_in_activation_order_real_shapes(M):
    """Llama-3-8B's o projection with its input in an activation order: both paths, x gathered by PDL's rules."""
    w, s, z = _weight(4096, 4096, 128, seed=M, device="cuda")
    x = torch.randn(M, 4096, device="cuda").to(torch.bfloat16)
    order = torch.randperm(4096, device="cuda")
    _close(int4.int4_linear(x, w, s, z, pdl=True, order=order), ref.int4_linear(x, w, s, z, order=order), ulps=2)


def test_hopper_kernel_only_where_it_applies():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert not int4_wgmma.supports(x, 256, 128)  # a CPU tensor
    p = int4_wgmma.plan(1, 4096, 4096, 132)
    assert p.block_m == 16 and p.split == 8  # 64 column tiles: about three programs an SM
    assert int4_wgmma.plan(64, 28672, 4096, 132) == int4_wgmma.Plan(64, 1)
    assert int4_wgmma.plan(128, 4096, 4096, 132) == int4_wgmma.Plan(64, 2)
    assert int4_wgmma.plan(256, 4096, 4096, 132).block_m == 128  # fewer tiles unpack the weight fewer times
    if HAS_CUDA:
        hopper = torch.cuda.get_device_capability() == (9, 0)
        dev = x.cuda()
        assert int4_wgmma.supports(dev, 256, 128) is hopper
        assert int4_wgmma.supports(dev, 256, 32) is hopper and int4_wgmma.supports(dev, 256, 256) is hopper
        assert not int4_wgmma.supports(dev, 256, 16) and not int4_wgmma.supports(dev, 256, 96)
        assert not int4_wgmma.supports(dev.float(), 256, 128)
        assert not int4_wgmma.supports(torch.zeros(257, 256, dtype=torch.bfloat16, device="cuda"), 256, 128)


@gpu
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("M", [1, 7, 16, 33, 64, 130])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hopper", [True, False])
def test_w4a16_gpu_kernels(group, M, dtype, hopper):
    """Both few-row kernels on the GPU (Hopper's where it runs, hopper=False this module's), with
    free zero points 0-16 (GPTQ v1's largest is 16), bias, and K split or not."""
    if hopper and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper's kernel")
    N, K = 200, 1024
    w, s, z = _weight(N, K, group, seed=M, device="cuda")
    z = torch.randint(0, 17, z.shape, generator=torch.Generator().manual_seed(M), dtype=torch.uint8).cuda()
    g = torch.Generator().manual_seed(M + 1)
    x = torch.randn(M, K, generator=g).to(dtype).cuda()
    b = torch.randn(N, generator=g).to(dtype).cuda()
    want = ref.int4_linear(x, w, s, z, b)
    if hopper:
        G = int4.group_of(w, s, z)
        for split in (1, 2, 8):
            bm = max(16, min(64, 1 << (M - 1).bit_length()))
            got = int4_wgmma.w4a16_matmul(x, w, s, z, G, b, p=int4_wgmma.Plan(bm, split))
            _close(got, want, ulps=2)
    _close(int4.w4a16_matmul(x, w, s, z, b, hopper=hopper), want, ulps=2)
