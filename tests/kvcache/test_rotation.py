"""The q/k rotation of a quantized KV cache (kvcache/rotation.py): exact in q.k, and it lowers
the score error of a quantized K whose energy sits in a few channels."""
import pytest
import torch

from kvcache import quant
from kvcache.rotation import QKRotation, hadamard


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_orthogonal_up_to_n(n):
    h = hadamard(n)
    assert torch.equal(h @ h.T, n * torch.eye(n))
    assert torch.equal(h, h.T)


def test_hadamard_refuses_other_sizes():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(96)


@pytest.mark.parametrize("d", [64, 128])
def test_rotation_keeps_every_score(d):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, d, generator=g, dtype=torch.float64), torch.randn(7, 2, d, generator=g, dtype=torch.float64)
    rot = QKRotation.build(d, dtype=torch.float64)
    q2, k2 = rot.apply(q, k)
    before = torch.einsum("thd,shd->tsh", q[:, :2], k)
    after = torch.einsum("thd,shd->tsh", q2[:, :2], k2) * rot.score_scale
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    assert rot.score_scale == (1.0 if d == 64 else 0.5)
    # entries are powers of two: building in bf16 loses nothing
    assert torch.equal(QKRotation.build(d, dtype=torch.bfloat16).r.double(), rot.r)


def test_adjacent_q_k_views_take_one_matmul_with_the_same_result():
    """q and k as views of a fused qkv row (the model's layout) give what separate tensors give."""
    t, hq, hkv, d = 6, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(2))
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    rot = QKRotation.build(d)
    q2, k2 = rot.apply(q, k)
    q3, k3 = rot.apply(q.clone(), k.clone())
    assert q2.shape == q.shape and k2.shape == k.shape
    torch.testing.assert_close(q2, q3, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k2, k3, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_rotation_lowers_the_score_error_of_outlier_channels(kv_dtype):
    """K and q with a few large shared channels (as RoPE'd keys have): the rotated, quantized K
    gives scores closer to the exact ones."""
    d = 64
    g = torch.Generator().manual_seed(1)
    k = torch.randn(256, 1, d, generator=g)
    q = torch.randn(32, 1, d, generator=g)
    k[..., :3] *= 20
    q[..., :3] *= 20
    exact = torch.einsum("thd,shd->ts", q, k)

    def score_error(q_, k_):
        kq, scale = quant.quantize(k_, kv_dtype)
        return (torch.einsum("thd,shd->ts", q_, quant.dequantize(kq, scale)) - exact).pow(2).mean().sqrt()

    plain = score_error(q, k)
    rot = QKRotation.build(d)
    q2, k2 = rot.apply(q, k)
    rotated = score_error(q2 * rot.score_scale, k2)
    assert rotated < 0.7 * plain, (float(rotated), float(plain))
