"""kernels/fp8.py against reference.fp8_linear / quantize_fp8: the input's FP8 values and scales bit
for bit, the product within a unit in the last place of its 16-bit output (the reference sums in
another order), for per-channel, 128 x 128 block and per-row block scales, split and unsplit K."""
import pytest
import torch

from engine.quant import quantize_weight
from kernels import fp8
from kernels import reference as ref
from tests.kernels.util import DEVICE, gpu


def _weight(N, K, form, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w, s = quantize_weight(torch.randn(N, K, generator=g) / K ** 0.5, blocked=form != "channel")
    if form == "rows":  # a row of block scales per weight row (packed q|k|v of small heads)
        s = s.repeat_interleave(128, 0)[:N]
    return w.to(device), s.to(device)


def _close(got, want, ulps: int = 1):
    tol = ulps * (2 ** -7 if got.dtype == torch.bfloat16 else 2 ** -10)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


def test_quantize_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 300, generator=g) * torch.logspace(-3, 2, 300)).to(torch.bfloat16).to(DEVICE)
    x[3] = 0  # a zero row keeps a finite scale
    for group in (300, 128):
        q, s = fp8.quantize(x, group)
        q_ref, s_ref = ref.quantize_fp8(x, group)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("form", ["channel", "blocks", "rows"])
@pytest.mark.parametrize("M", [1, 16, 40, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear(form, M, bias):
    N, K = 200, 512  # a partial 128-row block; K split over programs for few rows
    w, s = _weight(N, K, form, seed=M)
    g = torch.Generator().manual_seed(M + 1)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(N, generator=g).to(torch.bfloat16).to(DEVICE) if bias else None
    _close(fp8.fp8_linear(x, w, s, b), ref.fp8_linear(x, w, s, b))


def test_quantize_a_row_longer_than_one_read(monkeypatch):
    """Per-channel weights with K past MAX_BLOCK (Llama-3-70B's down at 28,672): the row in pieces."""
    monkeypatch.setattr(fp8, "MAX_BLOCK", 64)
    x = (torch.randn(3, 300) * torch.logspace(-2, 1, 300)).to(torch.bfloat16).to(DEVICE)
    for group in (300, 128):
        q, s = fp8.quantize(x, group)
        q_ref, s_ref = ref.quantize_fp8(x, group)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_fp8_linear_into_out_and_a_short_k():
    w, s = _weight(64, 96, "blocks", seed=3)  # K below one block: one scale per row's K
    x = torch.randn(3, 96).to(torch.bfloat16).to(DEVICE)
    out = torch.empty(3, 64, dtype=torch.bfloat16, device=DEVICE)
    assert fp8.fp8_linear(x, w, s, out=out) is out
    _close(out, ref.fp8_linear(x, w, s))


def test_gate_up_silu():
    w, s = _weight(2 * 128, 256, "blocks", seed=4)
    x = torch.randn(6, 256).to(torch.bfloat16).to(DEVICE)
    # three roundings to bf16 (product, SiLU, its product with up), which the interpreter truncates
    _close(fp8.fp8_gate_up_silu(x, w, s), ref.fp8_gate_up_silu(x, w, s), ulps=4)


@gpu
@pytest.mark.parametrize("M", [1, 64, 512, 2048])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (28672, 4096)])
@pytest.mark.parametrize("form", ["channel", "blocks"])
def test_fp8_linear_real_shapes(M, shape, form):
    N, K = shape
    w, s = _weight(N, K, form, seed=M, device="cuda")
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    _close(fp8.fp8_linear(x, w, s), ref.fp8_linear(x, w, s))


def test_which_scales_cublas_takes():
    """Row-wise scales and whole 128 x 128 blocks go to cuBLAS for many rows; per-row block scales,
    partial blocks and sizes off cuBLASLt's multiples of 16 stay on the Triton kernel."""
    w = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    assert fp8.cublas_scales(w, torch.ones(256, 1)).shape == (1, 256)
    assert fp8.cublas_scales(w, torch.ones(2, 3)).shape == (3, 2)
    assert fp8.cublas_scales(w, torch.ones(256, 3)) is None  # a row of block scales per weight row
    assert fp8.cublas_scales(torch.zeros(200, 384, dtype=torch.float8_e4m3fn), torch.ones(2, 3)) is None
    assert fp8.cublas_scales(torch.zeros(200, 390, dtype=torch.float8_e4m3fn), torch.ones(200, 1)) is None
