import math

import pytest
import torch

import kernels.paged_attention as pa
from kernels import launch
from kernels import reference as ref
from kernels.paged_attention import paged_decode_attention
from tests.kernels.util import DEVICE, REL_TOL, gpu, make_block_tables, make_cache, rel_err


def _run(seq_lens, Hq, Hkv, D, bs, dtype, kv, config=None, device=DEVICE, seed=0, extra_cols=1):
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-s // bs) for s in seq_lens)
    nb = need + 3
    kc, vc, ks, vs = make_cache(nb, Hkv, bs, D, dtype, kv, device, gen=g)
    bt = make_block_tables(seq_lens, bs, nb, extra_cols, gen=g, device=device)
    B = len(seq_lens)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 1 / math.sqrt(D)
    expect = ref.paged_decode_attention(q, kc, vc, bt, sl, scale, ks, vs)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = paged_decode_attention(q, kc, vc, bt, sl, scale, ks, vs, out=out, config=config)
    assert got is out
    assert not torch.isnan(got).any(), "unwritten or NaN output"
    err = rel_err(got, expect)
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"
    return got


@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_dtypes(dtype, kv):
    _run([1, 17, 40, 33], 8, 2, 32, 16, dtype, kv, seed=1)


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (6, 2), (16, 2)])
def test_decode_gqa(Hq, Hkv):
    _run([5, 31, 64], Hq, Hkv, 16, 16, torch.bfloat16, None, seed=Hq)


@pytest.mark.parametrize("bs,D", [(32, 16), (64, 32), (16, 64)])
@pytest.mark.parametrize("kv", [None, "int8"])
def test_decode_block_sizes(bs, D, kv):
    _run([bs + 3, 2 * bs - 1, 1], 4, 2, D, bs, torch.float16, kv, seed=bs)


@pytest.mark.parametrize("config", [
    {"num_splits": 1, "tile_n": 16},                      # no merge kernel
    {"num_splits": 3, "tile_n": 16, "prefetch": True},    # partitions not a multiple of the page
    {"num_splits": 2, "tile_n": 32, "prefetch": False},   # tiles span two pages
    {"num_splits": 8, "tile_n": 16, "prefetch": True},    # splits past every sequence's end
    {"num_splits": 2, "tile_n": 64, "prefetch": False},   # a tile longer than some sequences
])
@pytest.mark.parametrize("kv", [None, "fp8"])
def test_decode_splits(config, kv):
    _run([3, 47, 80, 16], 4, 2, 16, 16, torch.bfloat16, kv, config=config, seed=len(config), extra_cols=2)


@pytest.mark.parametrize("kv", [None, "int8"])
def test_decode_short_sequences_in_a_wide_table(kv):
    """Tables far wider than the sequences (a long max_model_len): each sequence's own length is
    split, so a short one runs on several splits and the merge combines them."""
    _run([1, 20, 33, 70, 129], 4, 2, 16, 16, torch.bfloat16, kv, config={"num_splits": 8, "tile_n": 16},
         seed=7, extra_cols=40)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_decode_scale_layouts_agree(kv):
    """The pool's paired scales (K's and V's of a page side by side) and two contiguous tensors of
    the same values give the same output bit for bit; scales of different strides are refused."""
    g = torch.Generator().manual_seed(11)
    kc, vc, ks, vs = make_cache(12, 2, 16, 32, torch.bfloat16, kv, DEVICE, gen=g)
    assert ks.stride() == (64, 32, 1)  # the views make_cache hands out by default
    bt = make_block_tables([37, 70], 16, 12, gen=g)
    sl = torch.tensor([37, 70], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    paired = paged_decode_attention(q, kc, vc, bt, sl, 0.2, ks, vs)
    separate = paged_decode_attention(q, kc, vc, bt, sl, 0.2, ks.contiguous(), vs.contiguous())
    assert torch.equal(paired, separate)
    with pytest.raises(AssertionError, match="same strides"):
        paged_decode_attention(q, kc, vc, bt, sl, 0.2, ks, vs.contiguous())


def test_decode_padded_graph_slot():
    """A padded CUDA-graph slot: seq_len 1 over block 0 beside real sequences."""
    g = torch.Generator().manual_seed(3)
    kc, vc, _, _ = make_cache(6, 2, 16, 32, torch.bfloat16, None, DEVICE, gen=g)
    bt = torch.tensor([[3, 1, 4], [0, 0, 0], [5, 2, 0]], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([40, 1, 20], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    got = paged_decode_attention(q, kc, vc, bt, sl, 0.2)
    assert rel_err(got, ref.paged_decode_attention(q, kc, vc, bt, sl, 0.2)) < REL_TOL[torch.bfloat16]


def test_decode_merge_counters_return_to_zero():
    """The last split to arrive merges and zeroes its counter: a second launch (the next layer, the
    next graph replay) with other lengths must merge again (its output starts as NaN)."""
    config = {"num_splits": 4, "tile_n": 16}
    _run([3, 47, 80, 16], 4, 2, 16, 16, torch.bfloat16, None, config=config, seed=11, extra_cols=2)
    _run([90, 1, 33, 64], 4, 2, 16, 16, torch.bfloat16, "int8", config=config, seed=12, extra_cols=2)
    assert all(not c.any() for kept in launch._COUNTERS.values() for c in kept)


def test_decode_launch_depends_on_shapes_only(monkeypatch):
    """The grid and the compile-time constants must not change with seq_lens (CUDA graphs)."""
    launches = []
    real = pa._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, {k: v for k, v in kwargs.items()}))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(pa, "_decode_kernel", Spy())
    g = torch.Generator().manual_seed(0)
    kc, vc, _, _ = make_cache(12, 2, 16, 16, torch.float16, None, DEVICE, gen=g)
    q = torch.randn(2, 4, 16, generator=g).to(torch.float16).to(DEVICE)
    bt = torch.arange(12, dtype=torch.int32, device=DEVICE).view(2, 6)
    for lens in ([1, 1], [96, 3], [50, 77]):
        paged_decode_attention(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=DEVICE), 0.25)
    assert len(launches) == 3 and launches[0] == launches[1] == launches[2]


def test_decode_config_is_bounded():
    for B in (1, 3, 64, 512):
        for ctx in (16, 1000, 4096, 131072):
            cfg = pa.decode_config(B, 8, ctx, 128, False)
            assert 1 <= cfg["num_splits"] <= 32 and cfg["tile_n"] >= 16


# ----------------------------------------------------------------------------- GPU, real shapes

@gpu
@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("D", [64, 128])
def test_decode_gpu_real_shapes(D, bs, dtype, kv):
    g = torch.Generator().manual_seed(D + bs)
    lens = torch.randint(1, 3000, (24,), generator=g).tolist() + [1, 4096, bs, bs + 1]
    _run(lens, 32, 8, D, bs, dtype, kv, device="cuda", seed=bs)


@gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 32, 128), (14, 2, 64), (28, 4, 128), (64, 8, 128), (16, 8, 256)])
def test_decode_gpu_model_heads(Hq, Hkv, D):
    _run([1, 100, 2049, 513], Hq, Hkv, D, 16, torch.bfloat16, None, device="cuda")


@gpu
def test_decode_gpu_float32():
    _run([1, 100, 777], 32, 8, 128, 16, torch.float32, None, device="cuda")
    _run([1, 100, 777], 32, 8, 128, 16, torch.float32, "int8", device="cuda")


def _captured_decode(B, Hq, Hkv, D, bs, max_blocks, kv, g):
    """Random pages, q, and a CUDA graph of one decode call over in-place block tables and lengths."""
    kc, vc, ks, vs = make_cache(B * max_blocks + 1, Hkv, bs, D, torch.bfloat16, kv, "cuda", gen=g)
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    sl = torch.ones(B, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, out=out)  # compile and allocate outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs, out=out)
    return graph, q, kc, vc, ks, vs, bt, sl, out


@gpu
@pytest.mark.parametrize("kv", [None, "fp8"])
def test_decode_gpu_cuda_graph_replay(kv):
    """Capture once, then change seq_lens and block tables in place and replay."""
    B, Hq, Hkv, D, bs, max_blocks = 8, 32, 8, 128, 16, 64
    g = torch.Generator().manual_seed(7)
    graph, q, kc, vc, ks, vs, bt, sl, out = _captured_decode(B, Hq, Hkv, D, bs, max_blocks, kv, g)
    for trial in range(3):
        lens = torch.randint(1, max_blocks * bs + 1, (B,), generator=g)
        lens[0] = 1  # a padded slot
        perm = torch.randperm(B * max_blocks, generator=g)[:B * max_blocks].view(B, max_blocks) + 1
        bt.copy_(perm.int())
        sl.copy_(lens.int())
        q.copy_(torch.randn(B, Hq, D, generator=g).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        expect = ref.paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs)
        assert rel_err(out, expect) < REL_TOL[torch.bfloat16]


def test_decode_plan_one_fat_program_per_pair_near_one_an_sm():
    """bf16 pages with 64-wide heads: where the (sequence, KV head) pairs about fill the SMs once
    (128-255 of them, the batch rounded up to a power of two), one 8-warp program of 128-token
    tiles each, no split; fewer pairs split, more keep 4-warp programs of 64-token tiles."""
    fat = pa.decode_config(64, 2, 32768, 64, False)
    assert (fat["num_splits"], fat["num_warps"], fat["tile_n"]) == (1, 8, 128)
    assert pa.decode_config(33, 2, 32768, 64, False) == fat  # the same variant for every batch that rounds to 64
    assert pa.decode_config(64, 3, 8192, 64, False)["num_splits"] == 1
    assert pa.decode_config(32, 2, 32768, 64, False)["num_splits"] > 1
    many = pa.decode_config(128, 2, 32768, 64, False)
    assert (many["num_warps"], many["tile_n"]) == (4, 64)
    for args in ((64, 2, 8192, 128, False), (64, 2, 32768, 64, False, True), (64, 2, 32768, 64, True)):
        assert pa.decode_config(*args)["num_warps"] == 4  # 128-wide heads, quantized pages, float32


@gpu
@pytest.mark.parametrize("B,Hq,Hkv,D,kv", [(32, 14, 2, 64, None), (8, 32, 8, 128, None), (4, 32, 8, 128, "fp8")])
def test_decode_gpu_cuda_graph_replays_merge(B, Hq, Hkv, D, kv):
    """One captured graph replayed many times with several splits, the last program of each
    (sequence, KV head) merging: every row checked, and a replay of the same inputs must give the
    same bits (a race on the arrival counters or a stale partial shows in either)."""
    bs, max_blocks = 16, 128
    assert pa.decode_config(B, Hkv, max_blocks * bs, D, False, kv is not None)["num_splits"] > 1
    g = torch.Generator().manual_seed(B)
    graph, q, kc, vc, ks, vs, bt, sl, out = _captured_decode(B, Hq, Hkv, D, bs, max_blocks, kv, g)
    for trial in range(50):
        lens = torch.randint(1, max_blocks * bs + 1, (B,), generator=g)
        lens[0] = 1  # a padded slot
        lens[-1] = torch.randint(1, 3 * 64, (1,), generator=g)  # within one or two splits
        bt.copy_((torch.randperm(B * max_blocks, generator=g).view(B, max_blocks) + 1).int())
        sl.copy_(lens.int())
        q.copy_(torch.randn(B, Hq, D, generator=g).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), f"replay {trial}: two replays of the same inputs differ"
        expect = ref.paged_decode_attention(q, kc, vc, bt, sl, 0.1, ks, vs).float()
        row_err = (out.float() - expect).norm(dim=-1) / expect.norm(dim=-1)
        assert row_err.max().item() < 2 * REL_TOL[torch.bfloat16], f"replay {trial}: row error {row_err.max():.2e}"
    assert all(not c.any() for kept in launch._COUNTERS.values() for c in kept)


@gpu
def test_decode_gpu_counters_never_allocated_during_capture(monkeypatch):
    monkeypatch.setattr(launch, "_COUNTERS", {})
    g = torch.Generator().manual_seed(0)
    kc, vc, _, _ = make_cache(64, 2, 16, 64, torch.bfloat16, None, "cuda", gen=g)
    q = torch.randn(4, 8, 64, generator=g).to(torch.bfloat16).cuda()
    bt = torch.arange(64, dtype=torch.int32, device="cuda").view(4, 16)
    sl = torch.full((4,), 200, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="eagerly"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            paged_decode_attention(q, kc, vc, bt, sl, 0.1, config={"num_splits": 4})
