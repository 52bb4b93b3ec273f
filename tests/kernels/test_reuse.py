"""On the GPU: one step's attention launch plan, reused by every layer (reuse=), computes exactly
what a full call per layer computes, and plans only once."""
from __future__ import annotations

import pytest
import torch

from kernels import launch, paged_attention, prefill_attention
from kernels import reference as ref
from kernels.paged_attention import paged_decode_attention
from kernels.prefill_attention import SRC_PAGES, SRC_PTR, SRC_TMA, paged_prefill_attention
from tests.kernels.util import gpu, make_block_tables, make_cache

LAYERS = 3


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    calls = [0]
    real = getattr(module, name)

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


@gpu
@pytest.mark.parametrize("same_q", [False, True])
@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("B", [3, 64])
def test_decode_reuse_equals_a_full_call_per_layer(monkeypatch, kv, B, same_q):
    """same_q: every layer passes one q object, refilled (a piecewise step's buffer): the relaunch
    then checks only the caches."""
    g = torch.Generator().manual_seed(B)
    Hq, Hkv, D, bs = 32, 8, 128, 16
    seq_lens = torch.randint(1, 700, (B,), generator=g).tolist()
    nb = sum(-(-s // bs) for s in seq_lens) + 4
    caches = [make_cache(nb, Hkv, bs, D, torch.bfloat16, kv, "cuda", gen=g) for _ in range(LAYERS)]
    bt = make_block_tables(seq_lens, bs, nb, extra_cols=40, gen=g, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qs = [torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda() for _ in range(LAYERS)]
    scales = [D ** -0.5 * (1 + 0.1 * i) for i in range(LAYERS)]
    want = [paged_decode_attention(q, c[0], c[1], bt, sl, s, c[2], c[3]) for q, c, s in zip(qs, caches, scales)]
    plans = _count_calls(monkeypatch, paged_attention, "decode_config")
    reuse: dict = {}
    out = torch.full((B, Hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    shared = torch.empty_like(qs[0])
    for q, c, s, w in zip(qs, caches, scales, want):
        if same_q:
            q = shared.copy_(q)
        got = paged_decode_attention(q, c[0], c[1], bt, sl, s, c[2], c[3], out=out, reuse=reuse)
        assert got is out and torch.equal(got, w)
    assert plans[0] == 1 and "decode" in reuse
    # a q of another shape plans again
    paged_decode_attention(qs[0][:2], caches[0][0], caches[0][1], bt[:2], sl[:2], scales[0], caches[0][2],
                           caches[0][3], reuse=reuse)
    assert plans[0] == 2


def _prefill_layer(q_lens, prefixes, Hq, Hkv, D, bs, kv, nb, bt, g, qkv):
    """One layer's caches with random prefixes, this step's q/k/v written into qkv (views), and
    k/v written into the pages."""
    kc, vc, ks, vs = make_cache(nb, Hkv, bs, D, torch.bfloat16, kv, "cuda", gen=g)
    qkv.copy_(torch.randn(qkv.shape, generator=g).to(qkv.dtype))
    T = qkv.shape[0]
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:(Hq + 2 * Hkv) * D].view(T, Hkv, D)
    slots = []
    for i, (ql, p) in enumerate(zip(q_lens, prefixes)):
        pos = torch.arange(p, p + ql)
        slots.append(bt[i].cpu()[pos // bs].long() * bs + pos % bs)
    ref.write_kv_cache(k, v, kc, vc, torch.cat(slots).cuda(), ks, vs, kv)
    return q, k, v, (kc, vc, ks, vs)


@gpu
@pytest.mark.parametrize("kv,tma,shared_qkv", [(None, True, True), (None, True, False), (None, False, False),
                                               ("fp8", True, True)])
def test_prefill_reuse_equals_a_full_call_per_layer(monkeypatch, kv, tma, shared_qkv):
    """shared_qkv: every layer passes the same q/k/v views of one buffer (the piecewise graphs'
    static buffer), so the TMA descriptors are reused and only the caches are checked; otherwise
    each layer has its own (eager steps)."""
    g = torch.Generator().manual_seed(7)
    Hq, Hkv, D, bs = 32, 8, 128, 16
    q_lens, prefixes = [300, 1, 77, 128], [0, 500, 40, 1024]
    seq_lens = [a + b for a, b in zip(q_lens, prefixes)]
    nb = sum(-(-s // bs) for s in seq_lens) + 4
    bt = make_block_tables(seq_lens, bs, nb, gen=g, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    T = sum(q_lens)
    config = {"tma": tma}
    plans = _count_calls(monkeypatch, prefill_attention, "prefill_plan")
    reuse: dict = {}
    out = torch.empty(T, Hq, D, dtype=torch.bfloat16, device="cuda")
    buf = torch.empty(T, (Hq + 2 * Hkv) * D, dtype=torch.bfloat16, device="cuda")
    srcs = set()
    for i in range(LAYERS):
        qkv = buf if shared_qkv else torch.empty_like(buf)
        q, k, v, (kc, vc, ks, vs) = _prefill_layer(q_lens, prefixes, Hq, Hkv, D, bs, kv, nb, bt, g, qkv)
        if shared_qkv and i:
            q, k, v = first
        first = (q, k, v)
        scale = D ** -0.5 * (1 + 0.1 * i)
        want = paged_prefill_attention(q, kc, vc, bt, sl, qsl, scale, ks, vs, max(q_lens), config=config, k=k, v=v)
        before = plans[0]
        got = paged_prefill_attention(q, kc, vc, bt, sl, qsl, scale, ks, vs, max(q_lens), config=config, k=k, v=v,
                                      out=out, reuse=reuse)
        assert got is out and torch.equal(got, want)
        assert plans[0] == before + (1 if i == 0 else 0)  # only the first layer plans
        srcs.add(reuse["prefill"][4])
    assert srcs == {SRC_PAGES.value if kv else (SRC_TMA if tma else SRC_PTR).value}


@gpu
def test_bound_relaunch_of_another_specialization_takes_the_normal_path():
    """A replacement that Triton would specialize differently (here a misaligned view) must not
    reuse the compiled kernel: Bound sends it through launch()."""
    x = torch.randn(4096 + 8, device="cuda")
    out = torch.zeros(4096 + 8, device="cuda")

    import triton
    import triton.language as tl

    @triton.jit
    def _double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    b = launch.bind(_double, (4,), x[:4096], out[:4096], 4096, BLOCK=1024)
    assert b is not None
    compiled = len(launch._KERNELS[_double].compiled)
    b(((0, x[1:4097]), (1, out[1:4097])))  # 4-byte offsets: not 16-byte aligned
    torch.cuda.synchronize()
    assert torch.equal(out[1:4097], x[1:4097] * 2)
    assert len(launch._KERNELS[_double].compiled) == compiled + 1
    b(((0, x[8:4104]),))  # aligned again (32 bytes): the bound kernel itself
    torch.cuda.synchronize()
    assert torch.equal(out[:4096], x[8:4104] * 2)
