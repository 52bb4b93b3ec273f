"""Hopper warp-specialized prefill attention (kernels/prefill_ws.py, Gluon), which
paged_prefill_attention launches by default on an H100 for 16-bit pages with this step's k/v: it
compiles for sm_90 on the CPU (Triton's own ptxas, no GPU) with warp specialization, wgmma and
TMA and no spills; on the GPU it matches the float32 reference with and without cached prefixes
(prefixes ending mid-page and mid-tile, the new tokens' page slots poisoned with NaN so that a
read of them shows), with a step's launch plan relaunched for another layer, and with
non-finite values in the pages' stale slots. Work lists: test_prefill_attention.py's GPU test
runs the engine's default plan, this kernel on an H100."""
from __future__ import annotations

import json

import pytest
import torch

from kernels import prefill_ws
from kernels import reference as ref
from kernels.prefill_attention import SRC_WS, paged_prefill_attention, prefill_plan
from tests.kernels.test_prefill_attention import _run
from tests.kernels.util import HAS_CUDA, REL_TOL, gpu, make_block_tables, make_cache, rel_err, run_outside_interpreter

ON_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")


@pytest.mark.skipif(prefill_ws.gluon is None, reason="this Triton has no Gluon")
def test_prefill_ws_compiles_for_sm90():
    out = run_outside_interpreter(["-m", "tests.kernels.sm90_compile", "--prefill-ws"], timeout=600)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 3
    for r in rows:
        assert r["local_bytes"] == 0, r  # no spills
        assert r["warpgroup_mma"] and r["tma_loads"] and r["setmaxnreg"], r
        assert r["shared_bytes"] <= 227 * 1024, r


def test_prefill_ws_not_planned_off_hopper():
    q = torch.randn(300, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(300, 2, 64, dtype=torch.bfloat16)
    kc = torch.randn(40, 2, 16, 64, dtype=torch.bfloat16)
    assert not prefill_plan(q, kc, 300, None, k, k.clone())["ws"]


@gpu
@hopper
def test_prefill_ws_plan():
    """The default for issue 3's case; not for quantized pages, float32, short chunks, or a config
    that asks for this file's tiles; for 64-wide heads only past the whole-step graphs' sizes."""
    q = torch.randn(4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.empty(300, 8, 16, 128, device="cuda", dtype=torch.bfloat16)
    plan = prefill_plan(q, kc, 2048, None, k, k.clone())
    assert plan["ws"] and plan["src"] == SRC_WS and plan["tok_m"] == prefill_ws.BLOCK_M
    assert not prefill_plan(q, kc, 64, None, k, k.clone())["ws"]
    assert not prefill_plan(q, kc, 2048, {"block_m": 64}, k, k.clone())["ws"]
    assert prefill_plan(q, kc, 2048, {"ws": True}, k, k.clone())["ws"]
    assert not prefill_plan(q, kc.to(torch.float8_e4m3fn), 2048, None, k, k.clone())["ws"]
    assert not prefill_plan(q.float(), kc.float(), 2048, None, k.float(), k.float())["ws"]
    assert not prefill_plan(q, kc, 2048, None)["ws"]  # no k/v: everything from the pages
    # 64-wide heads: the Triton kernel by default up to the whole-step graphs' largest step
    q64 = torch.randn(4096, 14, 64, device="cuda", dtype=torch.bfloat16)
    k64 = torch.randn(4096, 2, 64, device="cuda", dtype=torch.bfloat16)
    kc64 = torch.empty(300, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    assert not prefill_plan(q64, kc64, 2304, None, k64, k64.clone())["ws"]
    assert prefill_plan(q64, kc64, 2305, None, k64, k64.clone())["ws"]
    assert prefill_plan(q64, kc64, 512, {"ws": True}, k64, k64.clone())["ws"]


@gpu
@hopper
@pytest.mark.parametrize("q_lens,prefixes", [
    ([2048] * 4, [0] * 4),                              # issue 3's case
    ([1, 37, 128, 129, 255, 256, 300, 1000], [0] * 8),  # ragged chunks, no prefix
    ([300, 77, 129, 200], [128, 7, 2000, 4095]),        # prefix tile-aligned, mid-page, long
    ([70, 5000], [16, 1]),
    ([65, 0, 100], [3, 9, 250]),                        # an empty chunk between two
])
def test_prefill_ws_chunks_and_prefixes(q_lens, prefixes):
    plan = _run(q_lens, prefixes, 32, 8, 128, 16, torch.bfloat16, None, device="cuda", seed=len(q_lens),
                new_kv=True, expect_src=SRC_WS)
    assert plan["ws"]


@gpu
@hopper
@pytest.mark.parametrize("Hq,Hkv,D", [(14, 2, 64), (32, 32, 128), (28, 4, 128), (8, 1, 64)])
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_ws_heads_pages_dtypes(Hq, Hkv, D, bs, dtype):
    # {"ws": True}: 64-wide heads take the Triton kernel by default at these lengths
    _run([700, 131, 66], [0, 3 * bs + 5, 1000], Hq, Hkv, D, bs, dtype, None, {"ws": True}, device="cuda",
         seed=Hq + D + bs, new_kv=True, expect_src=SRC_WS)


@gpu
@hopper
def test_prefill_ws_relaunch_for_another_layer():
    """A step's plan (reuse) relaunched with another layer's pages and q/k/v gives that layer's
    result bit for bit, as a fresh launch does."""
    g = torch.Generator().manual_seed(9)
    q_lens, prefixes, Hq, Hkv, D, bs = [300, 90], [40, 0], 32, 8, 128, 16
    seq_lens = [a + b for a, b in zip(q_lens, prefixes)]
    nb = sum(-(-n // bs) for n in seq_lens) + 2
    bt = make_block_tables(seq_lens, bs, nb, gen=g, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 300, 390], dtype=torch.int32, device="cuda")
    layers = []
    for _ in range(2):
        kc, vc, _, _ = make_cache(nb, Hkv, bs, D, torch.bfloat16, None, "cuda", gen=g)
        qkv = torch.randn(390, (Hq + 2 * Hkv) * D, generator=g).to(torch.bfloat16).cuda()
        q, k, v = (qkv[:, :Hq * D].view(390, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(390, Hkv, D),
                   qkv[:, (Hq + Hkv) * D:].view(390, Hkv, D))
        layers.append((q, k, v, kc, vc))
    fresh = [paged_prefill_attention(q, kc, vc, bt, sl, qsl, 0.1, max_query_len=300, k=k, v=v)
             for q, k, v, kc, vc in layers]
    reuse: dict = {}
    got = [paged_prefill_attention(q, kc, vc, bt, sl, qsl, 0.1, max_query_len=300, k=k, v=v, reuse=reuse)
           for q, k, v, kc, vc in layers]
    assert reuse["prefill"][4] == SRC_WS
    for a, b in zip(got, fresh):
        assert torch.equal(a, b)


@gpu
@hopper
def test_prefill_ws_stale_non_finite_slots_stay_out():
    """Stale page slots (at or past a sequence's end, in its last page) holding NaN keys and inf
    values, and a neighbouring chunk whose own values are inf: the other chunks read those slots
    and rows in the tiles that run past their ends, with probability 0, and stay exact."""
    g = torch.Generator().manual_seed(12)
    q_lens, prefixes, Hq, Hkv, D, bs = [100, 3, 140], [37, 300, 0], 8, 2, 128, 32
    seq_lens = [a + b for a, b in zip(q_lens, prefixes)]
    nb = sum(-(-n // bs) for n in seq_lens) + 3
    kc, vc, _, _ = make_cache(nb, Hkv, bs, D, torch.bfloat16, None, "cuda", gen=g)
    bt = make_block_tables(seq_lens, bs, nb, gen=g, device="cuda")
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n, -(-n // bs) * bs)
        blk, off = bt[i].cpu()[pos // bs].long(), pos % bs
        kc[blk, :, off] = float("nan")
        vc[blk, :, off] = float("inf")
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(T, Hkv, D, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(T, Hkv, D, generator=g).to(torch.bfloat16).cuda()
    v[100:103] = float("inf")  # the middle chunk's own values: its result is not finite, the others' must be
    qsl = torch.tensor([0, 100, 103, 243], dtype=torch.int32, device="cuda")
    for i, (p, n) in enumerate(zip(prefixes, q_lens)):
        pos = torch.arange(p, p + n)
        blk, off = bt[i].cpu()[pos // bs].long(), pos % bs
        kc[blk, :, off] = k[qsl[i]:qsl[i] + n]
        vc[blk, :, off] = v[qsl[i]:qsl[i] + n]
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    assert prefill_plan(q, kc, 140, None, k, v)["ws"]
    out = paged_prefill_attention(q, kc, vc, bt, sl, qsl, D ** -0.5, max_query_len=140, k=k, v=v)
    expect = ref.paged_attention(q, kc, vc, bt, sl, qsl, D ** -0.5)
    for rows in (slice(0, 100), slice(103, 243)):
        assert torch.isfinite(out[rows].float()).all()
        assert rel_err(out[rows], expect[rows]) < REL_TOL[torch.bfloat16]


@gpu
@hopper
def test_prefill_ws_query_longer_than_sequence_stays_finite():
    """The runner's profiling pass: q_len > seq_len (nothing written): finite, no faults."""
    T, Hq, Hkv, D = 300, 8, 2, 128
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(4, Hkv, 16, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros((1, 4), dtype=torch.int32, device="cuda")
    sl = torch.tensor([64], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    assert prefill_plan(q, kc, T, None, k, k.clone())["ws"]
    out = paged_prefill_attention(q, kc, kc.clone(), bt, sl, qsl, 0.1, max_query_len=T, k=k, v=k.clone())
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
