"""rotary_decode_attention (rotary embedding, the KV write and decode attention in one kernel)
against the reference: apply_rotary with the write, then paged_decode_attention."""
from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from kernels.paged_attention import rotary_decode_attention
from tests.kernels.util import DEVICE, REL_TOL, gpu, make_block_tables, make_cache, rel_err

# the rotated k in the pages: as torch rounds it on the GPU; the interpreter's casts may differ by one unit
PAGE_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _cos_sin(max_pos: int, D: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(max_pos).float()[:, None] * inv[None]
    ang = torch.cat((ang, ang), dim=-1)
    return torch.stack((ang.cos(), ang.sin()), dim=1).contiguous()


def _inputs(seq_lens, Hq, Hkv, D, bs, dtype, device, g, pad=()):
    """Pages, block tables, this step's q, k, v (as views of one qkv projection, as the model makes
    them), positions and slots of each sequence's last token; rows in `pad` have slot -1."""
    nb = sum(-(-s // bs) for s in seq_lens) + 3
    kc, vc, _, _ = make_cache(nb, Hkv, bs, D, dtype, None, device, gen=g)
    bt = make_block_tables(seq_lens, bs, nb, 1, gen=g, device=device)
    B = len(seq_lens)
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(device)
    q = qkv[:, :Hq * D].view(B, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(B, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    slots = [int(bt[i, (s - 1) // bs]) * bs + (s - 1) % bs for i, s in enumerate(seq_lens)]
    for i in pad:
        slots[i] = -1
    slots = torch.tensor(slots, dtype=torch.int64, device=device)
    return kc, vc, bt, q, k, v, sl, sl.long() - 1, slots


def _check(seq_lens, Hq, Hkv, D, bs, dtype, config=None, pad=(), device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc, vc, bt, q, k, v, sl, pos, slots = _inputs(seq_lens, Hq, Hkv, D, bs, dtype, device, g, pad)
    cs = _cos_sin(max(seq_lens) + 5, D).to(device)
    ekc, evc = kc.clone(), vc.clone()
    expect = ref.rotary_decode_attention(q, k, v, pos, cs, ekc, evc, slots, bt, sl, D ** -0.5)
    q0, k0 = q.clone(), k.clone()
    out = torch.full_like(q, float("nan"))
    got = rotary_decode_attention(q, k, v, pos, cs, kc, vc, slots, bt, sl, D ** -0.5, out=out, config=config)
    assert got is out and torch.equal(q, q0) and torch.equal(k, k0), "q and k must stay as they were"
    torch.testing.assert_close(kc.float(), ekc.float(), atol=PAGE_TOL[dtype], rtol=PAGE_TOL[dtype])
    assert torch.equal(vc, evc)
    if device == "cuda":
        assert torch.equal(kc, ekc)
    # a padded row's new token is written nowhere, so the reference reads the old slot: not compared
    keep = [i for i in range(len(seq_lens)) if i not in pad]
    assert not torch.isnan(got[keep]).any(), "unwritten or NaN output"
    err = rel_err(got[keep], expect[keep])
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_decode_dtypes(dtype):
    _check([5, 40, 17, 1], 4, 2, 32, 16, dtype)


@pytest.mark.parametrize("Hq,Hkv,D,bs", [(2, 2, 16, 16), (6, 2, 32, 8), (16, 2, 64, 32)])
def test_rotary_decode_heads_and_pages(Hq, Hkv, D, bs):
    _check([3, 70, 33], Hq, Hkv, D, bs, torch.bfloat16, seed=Hq + D)


def test_rotary_decode_splits_and_the_owner():
    """Several splits: the new token can be a split's first (its loop is then empty), the only
    token of the sequence, or the last of a partly filled split; the other splits never see it."""
    config = {"num_splits": 4, "tile_n": 16}
    # part = 32 tokens at these lengths: 33 -> the owner is split 1 holding one token; 64 -> the
    # last of split 1; 1 -> split 0 holding only the new token
    _check([33, 64, 1, 100, 129], 4, 2, 32, 16, torch.bfloat16, config=config, seed=5)


def test_rotary_decode_padded_slot_writes_nowhere():
    _check([9, 30, 12], 4, 2, 32, 16, torch.bfloat16, config={"num_splits": 2, "tile_n": 16}, pad=(1,), seed=7)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,D,bs", [(14, 2, 64, 16), (32, 8, 128, 16), (28, 4, 128, 32), (16, 8, 256, 16)])
def test_rotary_decode_gpu_real_shapes(Hq, Hkv, D, bs, dtype):
    g = torch.Generator().manual_seed(D)
    lens = torch.randint(1, 2000, (64,), generator=g).tolist()
    lens[:3] = [1, 2, 4096]
    _check(lens, Hq, Hkv, D, bs, dtype, device="cuda", seed=Hq)


@gpu
@pytest.mark.parametrize("B", [32, 64])  # splits merged by the last to arrive; one program a (sequence, KV head)
def test_rotary_decode_gpu_cuda_graph_replays(B):
    """Captured once, replayed with new lengths, tables, positions, slots and projections: each
    replay equals the reference, and its merge counters end at zero."""
    Hq, Hkv, D, bs, max_blocks = 14, 2, 64, 16, 48
    g = torch.Generator().manual_seed(1)
    kc, vc, _, _ = make_cache(B * max_blocks + 1, Hkv, bs, D, torch.bfloat16, None, "cuda", gen=g)
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g).to(torch.bfloat16).cuda()
    q = qkv[:, :Hq * D].view(B, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(B, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D)
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    sl = torch.ones(B, dtype=torch.int32, device="cuda")
    pos = torch.zeros(B, dtype=torch.int64, device="cuda")
    slots = torch.full((B,), -1, dtype=torch.int64, device="cuda")
    cs = _cos_sin(max_blocks * bs, D).cuda()
    out = torch.empty_like(q)

    def call():
        rotary_decode_attention(q, k, v, pos, cs, kc, vc, slots, bt, sl, 0.125, out=out)

    call()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for trial in range(10):
        lens = torch.randint(1, max_blocks * bs + 1, (B,), generator=g)
        lens[0] = 1
        tables = (torch.randperm(B * max_blocks, generator=g).view(B, max_blocks) + 1).int()
        bt.copy_(tables)
        sl.copy_(lens.int())
        pos.copy_(lens - 1)
        last = tables[torch.arange(B), (lens - 1) // bs].long() * bs + (lens - 1) % bs
        last[-1] = -1  # a padded row
        slots.copy_(last)
        qkv.copy_(torch.randn(qkv.shape, generator=g).to(torch.bfloat16))
        ekc, evc = kc.clone(), vc.clone()
        expect = ref.rotary_decode_attention(q, k, v, pos, cs, ekc, evc, slots, bt, sl, 0.125)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc, ekc) and torch.equal(vc, evc)
        err = rel_err(out[:-1], expect[:-1])
        assert err < REL_TOL[torch.bfloat16], f"replay {trial}: relative error {err:.2e}"


@gpu
def test_rotary_decode_gpu_reuse_per_layer():
    """One step's plan relaunched for every layer (reuse=: the same tables, positions and slots,
    each layer's own pages and projections) equals a full call per layer."""
    B, Hq, Hkv, D, bs, layers = 32, 14, 2, 64, 16, 3
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 700, (B,), generator=g).tolist()
    kc, vc, bt, q, k, v, sl, pos, slots = _inputs(lens, Hq, Hkv, D, bs, torch.bfloat16, "cuda", g)
    per_layer = [(kc, vc, q, k, v)]
    for _ in range(layers - 1):
        c = make_cache(kc.shape[0], Hkv, bs, D, torch.bfloat16, None, "cuda", gen=g)
        qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g).to(torch.bfloat16).cuda()
        per_layer.append((c[0], c[1], qkv[:, :Hq * D].view(B, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(B, Hkv, D),
                          qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D)))
    cs = _cos_sin(800, D).cuda()
    want = [rotary_decode_attention(q, k, v, pos, cs, kc.clone(), vc.clone(), slots, bt, sl, 0.125)
            for kc, vc, q, k, v in per_layer]
    reuse: dict = {}
    for (kc, vc, q, k, v), w in zip(per_layer, want):
        got = rotary_decode_attention(q, k, v, pos, cs, kc, vc, slots, bt, sl, 0.125, reuse=reuse)
        assert torch.equal(got, w)
    assert "decode_rotary" in reuse
