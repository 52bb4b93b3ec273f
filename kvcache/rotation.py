"""The Walsh-Hadamard rotation of q and k that a quantized (fp8/int8) KV cache uses.

After RoPE, K and Q share a few large ("outlier") channels. Quantizing K per (token, head) with
one scale then spends its grid on those channels, and the error of q.k concentrates where q is
largest. Rotating both along head_dim by an orthogonal matrix leaves every q.k unchanged but
spreads the outlier energy over all channels: with an int8 cache the score error halves.

Convention (kvcache/quant.py refers here): for an fp8/int8 cache the engine computes, after
RoPE (and after Qwen3's q/k norm), q' = q @ R and k' = k @ R with

    R = H * 2**-a,  a = floor(log2(D) / 2)

where H is the +-1 Sylvester-Hadamard matrix of order D = head_dim (H @ H.T = D * I), so
R @ R.T = c * I with c = 2**(log2(D) - 2a) (1 when log2(D) is even, e.g. D = 64; 2 when odd,
e.g. D = 128) and q'.k' = c * q.k: attention multiplies its softmax scale by score_scale = 1/c.
R's entries are powers of two, exact in every float dtype: only the matmul's output is rounded.
(A k' twice as large is quantized to the same codes with twice the scale: nothing is lost by
not splitting the factor between q and k.) k' is what the cache stores (quantized, with a
per-token scale picked by the same token's q', kvcache/quant.py); attention runs on q' and the
cache (the kernels know nothing of the rotation). V is not rotated: it did not measurably help.
bf16/fp16/float32 caches are not rotated. RoPE does not commute with H, so the rotation can't be
folded into the q/k projection weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def hadamard(n: int) -> torch.Tensor:
    """The +-1 Sylvester-Hadamard matrix of order n (a power of two), float32: H @ H.T = n * I,
    symmetric."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim; got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@dataclass(frozen=True)
class QKRotation:
    """R [head_dim, head_dim], built once per pool (device, activation dtype), and the factor
    attention multiplies its softmax scale by."""
    r: torch.Tensor
    score_scale: float

    @classmethod
    def build(cls, head_dim: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> "QKRotation":
        h = hadamard(head_dim)
        log2 = head_dim.bit_length() - 1
        a = log2 // 2
        return cls((h * 2.0 ** -a).to(device=device, dtype=dtype), 2.0 ** -(log2 - 2 * a))

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> (q @ R, k @ R), in their dtype. When k's heads follow
        q's in one buffer (views of the model's fused qkv output), one matmul does both."""
        r = self.r.to(q.dtype)  # a no-op when the dtypes match
        hq = q.shape[1]
        if (k.dtype == q.dtype and k.stride() == q.stride() and q.stride(1) == q.shape[2] and q.stride(2) == 1
                and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
                and k.data_ptr() == q.data_ptr() + hq * q.stride(1) * q.element_size()):
            qk = torch.as_strided(q, (q.shape[0], hq + k.shape[1], q.shape[2]), q.stride()) @ r
            return qk[:, :hq], qk[:, hq:]
        return q @ r, k @ r
