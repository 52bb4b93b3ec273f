"""lab/tma_decode.py (decode attention with a TMA box per KV page) against the torch reference under
Triton's interpreter, one and two pages an iteration, ragged lengths with a partly filled last page.
Its speed is the lab script's business (H100, 2026-11-27: 1.6-2.4x slower than the engine's kernel)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.parametrize("pages", [1, 2])
def test_tma_decode_matches_reference(pages):
    from kernels import reference
    from lab.tma_decode import tma_decode

    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, bs, nb = 3, 14, 2, 64, 16, 20
    kc = torch.randn(nb, Hkv, bs, D, generator=g).bfloat16()
    vc = torch.randn(nb, Hkv, bs, D, generator=g).bfloat16()
    q = torch.randn(B, Hq, D, generator=g).bfloat16()
    bt = torch.randperm(nb, generator=g)[:B * 5].view(B, 5).to(torch.int32).contiguous()
    sl = torch.tensor([70, 33, 80], dtype=torch.int32)
    scale = 1 / math.sqrt(D)
    ref = reference.paged_decode_attention(q, kc, vc, bt, sl, scale).float()
    out = tma_decode(q, kc, vc, bt, sl, scale, pages=pages).float()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
