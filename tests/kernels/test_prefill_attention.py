import math

import pytest
import torch

from kernels import reference as ref
from kernels.prefill_attention import paged_prefill_attention
from tests.kernels.util import DEVICE, REL_TOL, gpu, make_block_tables, make_cache, rel_err


def _run(q_lens, prefixes, Hq, Hkv, D, bs, dtype, kv, config=None, device=DEVICE, seed=0, pass_max=True):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [a + b for a, b in zip(q_lens, prefixes)]
    need = sum(-(-s // bs) for s in seq_lens)
    nb = need + 2
    kc, vc, ks, vs = make_cache(nb, Hkv, bs, D, dtype, kv, device, gen=g)
    bt = make_block_tables(seq_lens, bs, nb, gen=g, device=device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(int(sum(q_lens)), Hq, D, generator=g).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 1 / math.sqrt(D)
    expect = ref.paged_attention(q, kc, vc, bt, sl, qsl, scale, ks, vs)
    got = paged_prefill_attention(q, kc, vc, bt, sl, qsl, scale, ks, vs,
                                  max_query_len=max(q_lens) if pass_max else None, config=config)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not torch.isnan(got).any()
    err = rel_err(got, expect)
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_dtypes(dtype, kv):
    # a fresh prompt, a chunk after a cached prefix, a single token after a prefix
    _run([13, 9, 1], [0, 21, 30], 4, 2, 32, 16, dtype, kv, seed=2)


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
])
def test_prefill_tilings(config):
    _run([40, 1, 23], [0, 50, 17], 2, 1, 16, 16, torch.bfloat16, "fp8", config=config, seed=5)


def test_prefill_empty_sequence_and_max_len_from_device():
    # a sequence with no new tokens (q_len 0) next to others; max_query_len computed by the launcher
    _run([6, 0, 11], [3, 8, 0], 2, 2, 16, 16, torch.float16, None, seed=4, pass_max=False)


# ----------------------------------------------------------------------------- GPU, real shapes

@gpu
@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_gpu_real_shapes(D, bs, dtype, kv):
    _run([512, 1000, 37, 1, 300], [0, 129, 2000, 4095, 60], 32, 8, D, bs, dtype, kv, device="cuda", seed=D + bs)


@gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 32, 128), (14, 2, 64), (16, 8, 256)])
def test_prefill_gpu_model_heads(Hq, Hkv, D):
    _run([700, 33], [0, 900], Hq, Hkv, D, 16, torch.bfloat16, None, device="cuda")


@gpu
def test_prefill_gpu_float32():
    _run([200, 7], [0, 300], 8, 2, 128, 16, torch.float32, None, device="cuda")
    _run([200, 7], [0, 300], 8, 2, 128, 16, torch.float32, "fp8", device="cuda")


@gpu
def test_prefill_gpu_long_chunks():
    _run([2048, 2048], [0, 2048], 32, 8, 128, 16, torch.bfloat16, None, device="cuda")
