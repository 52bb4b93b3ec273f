import math

import pytest
import torch

from kernels import reference as ref
from kernels.prefill_attention import (SRC_PAGES, SRC_PTR, SRC_TMA, WORK_PAD, paged_prefill_attention, prefill_plan,
                                       work_list)
from tests.kernels.util import DEVICE, REL_TOL, gpu, make_block_tables, make_cache, rel_err

PAGES, PTR, TMA = SRC_PAGES.value, SRC_PTR.value, SRC_TMA.value


def _slots(q_lens, prefixes, bt, bs, device):
    """The engine's slot mapping: each new token's page slot."""
    slots = []
    for i, (ql, p) in enumerate(zip(q_lens, prefixes)):
        pos = torch.arange(p, p + ql)
        slots.append(bt[i].cpu()[pos // bs].long() * bs + pos % bs)
    return torch.cat(slots).to(device) if slots else torch.zeros(0, dtype=torch.long, device=device)


def _run(q_lens, prefixes, Hq, Hkv, D, bs, dtype, kv, config=None, device=DEVICE, seed=0, pass_max=True,
         new_kv=False, expect_src=None, kv_values=None, pass_kv=True):
    """Random pages for the cached prefixes; with new_kv, this step's k/v are views of a fused qkv
    buffer (as in the model) written into the pages the engine's way and passed to the kernel,
    then the pages' copy of them is poisoned (NaN) when the kernel should read k/v instead, and
    k/v themselves are poisoned when it should not (quantized pages): a wrong source shows.
    kv_values(q, k, v) may set them in place first; pass_kv=False keeps them from the kernel."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [a + b for a, b in zip(q_lens, prefixes)]
    need = sum(-(-s // bs) for s in seq_lens)
    nb = need + 2
    kc, vc, ks, vs = make_cache(nb, Hkv, bs, D, dtype, kv, device, gen=g)
    bt = make_block_tables(seq_lens, bs, nb, gen=g, device=device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    T = int(sum(q_lens))
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 1 / math.sqrt(D)
    k = v = None
    if new_kv:
        width = (Hq + 2 * Hkv) * D + 8  # padded row: k/v row stride is not a multiple of their width
        qkv = (torch.randn(T, width, generator=g) * 1.5).to(dtype).to(device)
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:(Hq + 2 * Hkv) * D].view(T, Hkv, D)
        if kv_values is not None:
            kv_values(q, k, v)
        slots = _slots(q_lens, prefixes, bt, bs, device)
        ref.write_kv_cache(k, v, kc, vc, slots, ks, vs, kv)
        if not pass_kv:
            k = v = None
    else:
        q = torch.randn(T, Hq, D, generator=g).to(dtype).to(device)
    expect = ref.paged_attention(q, kc, vc, bt, sl, qsl, scale, ks, vs)
    plan = prefill_plan(q, kc, max(q_lens), config, k, v)
    if expect_src is not None:
        assert plan["src"] == expect_src, plan
    if k is not None:
        if plan["src"] == PAGES:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        else:
            blk, off = slots // bs, slots % bs
            kc[blk, :, off] = float("nan")
            vc[blk, :, off] = float("nan")
    got = paged_prefill_attention(q, kc, vc, bt, sl, qsl, scale, ks, vs,
                                  max_query_len=max(q_lens) if pass_max else None, config=config, k=k, v=v)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not torch.isnan(got).any()
    err = rel_err(got, expect)
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"
    return plan


# ----------------------------------------------------------------------------- all keys from the pages

@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_dtypes(dtype, kv):
    # a fresh prompt, a chunk after a cached prefix, a single token after a prefix
    _run([13, 9, 1], [0, 21, 30], 4, 2, 32, 16, dtype, kv, seed=2, expect_src=PAGES)


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (6, 3)])
def test_prefill_gqa(Hq, Hkv):
    _run([7, 18], [5, 0], Hq, Hkv, 16, 16, torch.bfloat16, None, seed=Hq)


@pytest.mark.parametrize("bs,D", [(32, 16), (64, 32)])
@pytest.mark.parametrize("kv", [None, "int8"])
def test_prefill_block_sizes(bs, D, kv):
    _run([bs + 5, 3], [bs - 1, 2 * bs + 7], 2, 1, D, bs, torch.float16, kv, seed=bs)


@pytest.mark.parametrize("config", [
    {"block_m": 16, "block_n": 16},   # several query tiles, several masked key tiles
    {"block_m": 32, "block_n": 16},
    {"block_m": 16, "block_n": 32},   # key tile spans two pages
    {"block_m": 32, "block_n": 16, "block_n_prefix": 16, "pack_gqa": True, "lazy_rescale": True},
])
def test_prefill_tilings(config):
    _run([40, 1, 23], [0, 50, 17], 2, 1, 16, 16, torch.bfloat16, "fp8", config=config, seed=5)


def test_prefill_empty_sequence_and_max_len_from_device():
    # a sequence with no new tokens (q_len 0) next to others; max_query_len computed by the launcher
    _run([6, 0, 11], [3, 8, 0], 2, 2, 16, 16, torch.float16, None, seed=4, pass_max=False)


# ----------------------------------------------------------------------------- new keys from k/v

@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_new_kv_dtypes(dtype, tma):
    # no prefix, prefixes that end mid-page, a single token; the chunks are not page aligned
    _run([13, 9, 1, 40], [0, 21, 30, 17], 4, 2, 32, 16, dtype, None, config={"tma": tma}, seed=3, new_kv=True,
         expect_src=TMA if tma else PTR)


@pytest.mark.parametrize("Hq,Hkv,D,bs", [
    (8, 2, 64, 16),    # group 4, packed
    (4, 1, 128, 32),   # group 4, head_dim 128, 32-token pages
    (6, 3, 64, 32),    # group 2
    (3, 1, 64, 16),    # group 3: not a power of two, no packing
    (2, 2, 128, 16),   # MHA
])
def test_prefill_new_kv_shapes(Hq, Hkv, D, bs):
    # the default (TMA, no packing) and packed strided loads, where the group allows packing
    _run([21, 37, 2], [0, bs + 3, 2 * bs - 1], Hq, Hkv, D, bs, torch.bfloat16, None, seed=Hq + D,
         new_kv=True, expect_src=TMA)
    plan = _run([21, 37, 2], [0, bs + 3, 2 * bs - 1], Hq, Hkv, D, bs, torch.bfloat16, None, seed=Hq + D,
                new_kv=True, expect_src=PTR, config={"tma": False, "pack_gqa": True, "block_m": 128, "block_n": 32})
    assert plan["pack_gqa"] == (Hq // Hkv in (2, 4))


@pytest.mark.parametrize("config", [
    {"block_m": 16, "block_n": 16, "block_n_prefix": 16, "pack_gqa": False, "lazy_rescale": False},
    {"block_m": 32, "block_n": 16, "block_n_prefix": 32, "pack_gqa": False, "lazy_rescale": True},
    {"block_m": 32, "block_n": 16, "block_n_prefix": 32, "pack_gqa": True},   # 16 tokens x 2 heads
    {"block_m": 16, "block_n": 32, "block_n_prefix": 16, "pack_gqa": True, "tma": True},  # key tile > query tile
    {"block_m": 64, "block_n": 16, "block_n_prefix": 64, "pack_gqa": True, "lazy_rescale": False, "tma": True},
])
def test_prefill_new_kv_tilings(config):
    _run([40, 1, 23, 70], [0, 50, 17, 5], 4, 2, 16, 16, torch.float16, None, config=config, seed=6, new_kv=True)


def test_prefill_new_kv_empty_sequence_and_max_len_from_device():
    _run([6, 0, 11], [3, 8, 0], 4, 2, 16, 16, torch.bfloat16, None, seed=7, pass_max=False, new_kv=True)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_prefill_quantized_pages_ignore_new_kv(kv):
    # the engine passes k/v for every cache dtype; quantized pages are read as before (k/v poisoned)
    _run([13, 9, 1], [0, 21, 30], 4, 2, 32, 16, torch.bfloat16, kv, seed=8, new_kv=True, expect_src=PAGES,
         config={"tma": True})


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_prefill_scale_layouts_agree(kv):
    """Paired scale views (the pool's) and contiguous copies give the same output bit for bit."""
    g = torch.Generator().manual_seed(12)
    kc, vc, ks, vs = make_cache(10, 2, 16, 32, torch.bfloat16, kv, DEVICE, gen=g)
    bt = make_block_tables([40, 25], 16, 10, gen=g)
    sl = torch.tensor([40, 25], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 9, 14], dtype=torch.int32, device=DEVICE)
    q = torch.randn(14, 4, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    paired = paged_prefill_attention(q, kc, vc, bt, sl, qsl, 0.2, ks, vs)
    separate = paged_prefill_attention(q, kc, vc, bt, sl, qsl, 0.2, ks.contiguous(), vs.contiguous())
    assert ks.stride() != ks.contiguous().stride() and torch.equal(paired, separate)


def test_prefill_new_kv_other_dtype_than_pages():
    # float16 pages for a bfloat16 model: the pages hold converted values, so they are read instead
    g = torch.Generator().manual_seed(9)
    kc, vc, _, _ = make_cache(4, 2, 16, 32, torch.float16, None, DEVICE, gen=g)
    q = torch.randn(5, 4, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(5, 2, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    assert prefill_plan(q, kc, 5, None, k, k)["src"] == PAGES


@pytest.mark.parametrize("pass_kv", [False, True])
@pytest.mark.parametrize("lazy", [False, True])
def test_prefill_lazy_rescale_growing_max(pass_kv, lazy):
    # every query aligned with u; scores against u-aligned keys grow along the sequence by 4.3
    # (log2 units) every 20 keys, 22 in all: the lazy rescale skips small growth and must rescale
    # before float16 probabilities overflow (2^16)
    def values(q, k, v):
        g = torch.Generator().manual_seed(12)
        D = q.shape[-1]
        u = (torch.ones(D) / math.sqrt(D)).to(q.device)
        pos = torch.arange(k.shape[0], dtype=torch.float32, device=k.device)
        c = 3 * (pos // 20) + 0.2 * (pos % 20)
        q.copy_((4 * u + 0.3 * torch.randn(q.shape, generator=g).to(q.device)).to(q.dtype))
        k.copy_((c[:, None, None] * u + 0.3 * torch.randn(k.shape, generator=g).to(k.device)).to(k.dtype))
    plan = _run([110], [0], 2, 1, 16, 16, torch.float16, None, seed=10, new_kv=True, pass_kv=pass_kv,
                config={"lazy_rescale": lazy, "block_m": 16, "block_n": 16, "block_n_prefix": 16},
                kv_values=values, expect_src=TMA if pass_kv else PAGES)
    assert plan["lazy_rescale"] == lazy


@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_query_longer_than_sequence_stays_in_bounds(new_kv):
    # the runner's profiling pass: q_len > seq_len (nothing written). Garbage in, but keys stay
    # within [0, seq_len) and the chunk's k/v rows: finite output, no out-of-range reads
    g = torch.Generator().manual_seed(11)
    kc, vc, _, _ = make_cache(1, 2, 16, 32, torch.bfloat16, None, DEVICE, gen=g)
    T = 40
    q = torch.randn(T, 4, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(T, 2, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(T, 2, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    bt = torch.zeros((1, 1), dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([16], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=DEVICE)
    kw = {"k": k, "v": v} if new_kv else {}
    out = paged_prefill_attention(q, kc, vc, bt, sl, qsl, 0.2, max_query_len=T,
                                  config={"block_m": 16, "block_n": 16, "block_n_prefix": 16}, **kw)
    assert torch.isfinite(out.float()).all()


def _work_list_case(new_kv, kv=None, dtype=torch.bfloat16, D=32, bs=16, Hq=4, Hkv=2, device=DEVICE,
                    cfg=(("block_m", 16), ("block_n", 16), ("block_n_prefix", 16)), q_lens=(5, 19, 1)):
    """A whole-step graph's layout (engine/mixed_graph.py): 3 decode rows first, then chunks of
    5 / 19 / 1 tokens after prefixes of 0 / 7 / 30, the chunks' sequences at indices 4.. of
    seq_lens, block tables and query starts (absolute rows of q), and 2 rows of padding. The work
    list's launch must give the plain launch's rows bit for bit and leave the other rows alone."""
    g = torch.Generator().manual_seed(5)
    q_lens, prefixes, nd, first = list(q_lens), [0, 7, 30], 3, 4
    seq_lens = [a + b for a, b in zip(q_lens, prefixes)]
    nb = sum(-(-n // bs) for n in seq_lens) + 2
    kc, vc, ks, vs = make_cache(nb, Hkv, bs, D, dtype, kv, device, gen=g)
    bt = make_block_tables(seq_lens, bs, nb, gen=g, device=device)
    T = nd + sum(q_lens) + 2
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype).to(device)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype).to(device)
    rows = slice(nd, nd + sum(q_lens))
    ref.write_kv_cache(k[rows], v[rows], kc, vc, _slots(q_lens, prefixes, bt, bs, device), ks, vs, kv)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    kw = {"k": k[rows], "v": v[rows]} if new_kv else {}
    cfg = dict(cfg) if cfg else None
    plain = paged_prefill_attention(q[rows], kc, vc, bt, sl, qsl, 0.3, ks, vs, max(q_lens), config=cfg, **kw)
    # the graph's arrays: sequence index first + i, padding entries elsewhere
    n_all = first + len(q_lens) + 1
    sl_all = torch.ones(n_all, dtype=torch.int32, device=device)
    sl_all[first:first + len(q_lens)] = sl
    bt_all = torch.zeros((n_all, bt.shape[1]), dtype=torch.int32, device=device)
    bt_all[first:first + len(q_lens)] = bt
    qsl_all = torch.zeros(n_all + 1, dtype=torch.int32, device=device)
    qsl_all[first:first + len(q_lens) + 1] = qsl + nd
    tok_m = prefill_plan(q, kc, T, cfg, k if new_kv else None, v if new_kv else None)["tok_m"]
    seqs = list(range(first, first + len(q_lens)))
    work = torch.from_numpy(work_list(seqs, q_lens, tok_m, 40)).to(device)
    items = sum(-(-n // tok_m) for n in q_lens)
    assert work_list(seqs, q_lens, tok_m, items - 1) is None
    out = torch.full_like(q, 7.0)
    kw = {"k": k, "v": v} if new_kv else {}
    paged_prefill_attention(q, kc, vc, bt_all, sl_all, qsl_all, 0.3, ks, vs, T, config=cfg, out=out, work=work, **kw)
    assert torch.equal(out[rows], plain)
    assert (out[:nd] == 7).all() and (out[rows.stop:] == 7).all()


@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_work_list_equals_plain_grid(new_kv):
    _work_list_case(new_kv)


def test_prefill_work_list_quantized_pages():
    _work_list_case(False, kv="fp8")


def test_work_list_order_and_padding():
    items = work_list([4, 5], [65, 10], 64, 4)
    assert items.tolist() == [(4 << 16) | 1, 4 << 16, 5 << 16, WORK_PAD]


# ----------------------------------------------------------------------------- GPU, real shapes

@gpu
@pytest.mark.parametrize("new_kv", [False, True])
@pytest.mark.parametrize("kv", [None, "fp8"])
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (14, 2, 64)])
def test_prefill_gpu_work_list(Hq, Hkv, D, kv, new_kv):
    # the engine's plan (TMA loads of the new keys for bf16 pages) over a whole-step graph's layout
    _work_list_case(new_kv, kv, torch.bfloat16, D, 16 if kv is None else 32, Hq, Hkv, "cuda", cfg=None,
                    q_lens=(300, 77, 1))


@gpu
@pytest.mark.parametrize("new_kv", [False, True])
@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_gpu_real_shapes(D, bs, dtype, kv, new_kv):
    # this file's kernel ({"ws": False}; the default on an H100 for 128-wide heads is prefill_ws.py's, tested there too)
    _run([512, 1000, 37, 1, 300], [0, 129, 2000, 4095, 60], 32, 8, D, bs, dtype, kv, device="cuda", seed=D + bs,
         new_kv=new_kv, expect_src=TMA if new_kv and kv is None else PAGES, config={"ws": False})
    if new_kv and kv is None:  # the default plan: prefill_ws.py's kernel on an H100 for 128-wide heads
        plan = _run([512, 1000, 37, 1, 300], [0, 129, 2000, 4095, 60], 32, 8, D, bs, dtype, kv, device="cuda",
                    seed=D + bs, new_kv=new_kv)
        assert plan["ws"] == (torch.cuda.get_device_capability() == (9, 0) and D > 64)


@gpu
@pytest.mark.parametrize("new_kv", [False, True])
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 32, 128), (14, 2, 64), (16, 8, 256)])
def test_prefill_gpu_model_heads(Hq, Hkv, D, new_kv):
    _run([700, 33], [0, 900], Hq, Hkv, D, 16, torch.bfloat16, None, device="cuda", new_kv=new_kv)


@gpu
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_gpu_float32(new_kv):
    _run([200, 7], [0, 300], 8, 2, 128, 16, torch.float32, None, device="cuda", new_kv=new_kv)
    _run([200, 7], [0, 300], 8, 2, 128, 16, torch.float32, "fp8", device="cuda", new_kv=new_kv)


@gpu
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_gpu_long_chunks(new_kv):
    _run([2048, 2048], [0, 2048], 32, 8, 128, 16, torch.bfloat16, None, device="cuda", new_kv=new_kv)


@gpu
@pytest.mark.parametrize("config", [
    {"tma": True}, {"pack_gqa": False}, {"lazy_rescale": False}, {"tma": True, "pack_gqa": False},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "tma": True},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 256, "block_n": 32, "num_warps": 8, "num_stages": 3, "block_n_prefix": 64},
])
def test_prefill_gpu_new_kv_configs(config):
    # the main alternatives of lab.kernels --sweep, Llama-3-8B heads, with and without a prefix
    _run([1100, 2048, 300], [0, 0, 777], 32, 8, 128, 16, torch.bfloat16, None, config=config, device="cuda",
         new_kv=True)
