import pytest
import torch

from kernels import fused, reference as ref
from tests.kernels.util import DEVICE, gpu

# one or two units in the last place of the dtype: the kernels round where torch rounds, but
# rsqrt/exp differ in the last bit, and Triton's CPU interpreter truncates float32 -> bf16
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(a, b, tol_dtype=None):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    t = tol_dtype or b.dtype
    torch.testing.assert_close(a.float(), b.float(), atol=ATOL[t], rtol=RTOL[t])


def _cos_sin(max_pos, D, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    t = torch.arange(max_pos).float()[:, None] * inv[None]
    emb = torch.cat([t, t], dim=-1)
    return torch.stack([emb.cos(), emb.sin()], dim=1)


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 64), (1, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(shape, dtype, wdtype, with_residual, device=DEVICE):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(wdtype).to(device)
    r = torch.randn(shape, generator=g).to(dtype).to(device) if with_residual else None
    x0 = x.clone()
    got = fused.rms_norm(x, w, 1e-6, r)
    expect = ref.rms_norm(x, w, 1e-6, r)
    assert torch.equal(x, x0), "x must not be modified"
    if with_residual:
        _close(got[0], expect[0], dtype)
        _close(got[1], expect[1])
    else:
        _close(got, expect, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (3, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_in_an_order(shape, dtype, with_residual, device=DEVICE):
    """order: the normed columns in a 4-bit weight's activation order, bit for bit the kernel's own
    output gathered (and the reference's, gathered, within its tolerance); the residual unchanged."""
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(device)
    r = torch.randn(shape, generator=g).to(dtype).to(device) if with_residual else None
    order = torch.randperm(shape[-1], generator=g).to(device)
    plain = fused.rms_norm(x, w, 1e-6, r)
    got = fused.rms_norm(x, w, 1e-6, r, order=order)
    expect = ref.rms_norm(x, w, 1e-6, r, order=order)
    if with_residual:
        assert torch.equal(got[1], plain[1])
        plain, got, expect = plain[0], got[0], expect[0]
    assert torch.equal(got, plain[:, order])
    _close(got, expect, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,Hq,Hk,D", [(6, 4, 2, 32), (3, 3, 1, 16), (1, 8, 8, 64)])
def test_rotary(T, Hq, Hk, D, dtype, device=DEVICE):
    g = torch.Generator().manual_seed(T * D)
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(T, Hk, D, generator=g).to(dtype).to(device)
    cs = _cos_sin(300, D).to(device)
    pos = torch.randint(0, 300, (T,), generator=g).to(device)
    eq, ek = ref.apply_rotary(q, k, pos, cs)
    gq, gk = fused.apply_rotary(q.clone(), k.clone(), pos, cs)
    _close(gq, eq)
    _close(gk, ek)
    if device == "cuda":  # rounded as torch rounds (the interpreter's casts may differ by one unit)
        assert torch.equal(gq, eq) and torch.equal(gk, ek)


def test_rotary_strided_views_in_place(device=DEVICE):
    """q, k as views of one fused qkv projection output are rotated in place; v is untouched."""
    T, Hq, Hk, D = 5, 4, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hk) * D).to(torch.float16).to(device)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
    v_before = qkv[:, (Hq + Hk) * D:].clone()
    cs = _cos_sin(64, D).to(device)
    pos = torch.arange(T).to(device) * 7
    eq, ek = ref.apply_rotary(q, k, pos, cs)
    gq, gk = fused.apply_rotary(q, k, pos, cs)
    _close(q, eq)
    _close(k, ek)
    assert gq.data_ptr() == q.data_ptr()
    assert torch.equal(qkv[:, (Hq + Hk) * D:], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,Hq,Hk,D,bs", [(7, 4, 2, 32, 4), (3, 3, 1, 16, 16), (5, 14, 2, 64, 8)])
def test_rotary_with_kv_write(T, Hq, Hk, D, bs, dtype, device=DEVICE):
    """Rotary plus the KV write in one kernel == rotary, then write_kv_cache; slot -1 writes nothing,
    and the pages' other slots keep their values."""
    g = torch.Generator().manual_seed(T * D + bs)
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(T, Hk, D, generator=g).to(dtype).to(device)
    v = torch.randn(T, Hk, D, generator=g).to(dtype).to(device)
    cs = _cos_sin(300, D).to(device)
    pos = torch.randint(0, 300, (T,), generator=g).to(device)
    nb = (2 * T) // bs + 2
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[T // 2] = -1  # a padded graph row (the only row when T = 1)
    slots = slots.to(device)
    kc = torch.randn(nb, Hk, bs, D, generator=g).to(dtype).to(device)
    vc = torch.randn(nb, Hk, bs, D, generator=g).to(dtype).to(device)
    ekc, evc = kc.clone(), vc.clone()
    eq, ek = ref.apply_rotary(q, k, pos, cs, v, ekc, evc, slots)
    gq, gk = fused.apply_rotary(q.clone(), k.clone(), pos, cs, v, kc, vc, slots)
    _close(gq, eq)
    _close(gk, ek)
    _close(kc, ekc)
    assert torch.equal(vc, evc)
    if device == "cuda":
        assert torch.equal(gq, eq) and torch.equal(kc, ekc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 80), (2, 2, 2 * 1500), (1, 32)])
def test_silu_and_mul(shape, dtype, device=DEVICE):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    _close(fused.silu_and_mul(x), ref.silu_and_mul(x))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 64, 4097])
def test_fused_gpu_real_shapes(rows, dtype):
    test_rms_norm((rows, 4096), dtype, dtype, True, device="cuda")
    test_rms_norm((rows, 896), dtype, dtype, False, device="cuda")
    test_rms_norm_in_an_order((rows, 4096), torch.bfloat16, True, device="cuda")
    test_rotary(rows, 32, 8, 128, dtype, device="cuda")
    test_rotary(rows, 14, 2, 64, dtype, device="cuda")
    test_rotary_with_kv_write(max(rows, 2), 32, 8, 128, 16, dtype, device="cuda")
    test_rotary_with_kv_write(max(rows, 2), 14, 2, 64, 16, dtype, device="cuda")
    test_silu_and_mul((rows, 2 * 14336), dtype, device="cuda")
    test_silu_and_mul((rows, 2 * 4864), dtype, device="cuda")
