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
    after = torch.einsum("thd,shd->tsh", q2[:, :2], k2)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    # entries are powers of two: building in bf16 loses nothing
    assert torch.equal(QKRotation.build(d, dtype=torch.bfloat16).q.double(), rot.q)


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
    rotated = score_error(*QKRotation.build(d).apply(q, k))
    assert rotated < 0.7 * plain, (float(rotated), float(plain))
