"""The Walsh-Hadamard rotation of q and k that a quantized (fp8/int8) KV cache uses.

After RoPE, K and Q share a few large ("outlier") channels. Quantizing K per (token, head) with
one scale then spends its grid on those channels, and the error of q.k concentrates where q is
largest. Rotating both along head_dim by an orthogonal matrix leaves every q.k unchanged but
spreads the outlier energy over all channels: with an int8 cache the score error halves.

Convention (kvcache/quant.py refers here): for an fp8/int8 cache the engine computes, after
RoPE (and after Qwen3's q/k norm), q' = q @ R_q and k' = k @ R_k with

    R_q = H * 2**-a,  R_k = H * 2**-b,  a = floor(log2(D) / 2),  b = ceil(log2(D) / 2)

where H is the +-1 Sylvester-Hadamard matrix of order D = head_dim (H @ H.T = D * I), so
R_q @ R_k.T = I and q'.k' = q.k. Both are orthogonal up to a power of two (exactly orthonormal,
H / sqrt(D), when log2(D) is even, e.g. D = 64) and their entries are powers of two, exact in
every float dtype: only the matmul's output is rounded. k' is what the cache stores (quantized);
attention runs on q' and the cache unchanged (the kernels know nothing of the rotation). V is
not rotated: it did not measurably help. bf16/fp16/float32 caches are not rotated.
RoPE does not commute with H, so the rotation can't be folded into the q/k projection weights.
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
    """R_q and R_k [head_dim, head_dim], built once per pool (device, activation dtype)."""
    q: torch.Tensor
    k: torch.Tensor

    @classmethod
    def build(cls, head_dim: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> "QKRotation":
        h = hadamard(head_dim)
        log2 = head_dim.bit_length() - 1
        a, b = log2 // 2, log2 - log2 // 2
        return cls((h * 2.0 ** -a).to(device=device, dtype=dtype), (h * 2.0 ** -b).to(device=device, dtype=dtype))

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> (q @ R_q, k @ R_k), in their dtype."""
        return q @ self.q.to(q.dtype), k @ self.k.to(k.dtype)  # .to is a no-op when dtypes match
