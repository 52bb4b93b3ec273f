import pytest
import torch
from kernels import reference as ref
from kernels.cache_write import write_kv_cache
from kvcache import quant
from tests.kernels.util import DEVICE, KV_STORAGE, gpu


def _caches(nb, H, bs, D, dtype, kv, device):
    st = KV_STORAGE[kv] or dtype
    kc = torch.randn(nb, H, bs, D).to(st).to(device)
    vc = torch.randn(quant.v_page_shape((nb, H, bs, D), kv is not None)).to(st).to(device)
    if not kv:
        return kc, vc, None, None
    ks, vs = quant.scale_views(quant.new_scales(nb, H, bs, device).uniform_())  # the pool's layout
    return kc, vc, ks, vs


def _same(a, b):
    if a is None:
        return b is None
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _diff(x, y, k, v, slots, ref_scale):
    """A few differing elements (reference, kernel) for the failure message."""
    xf, yf = x.float(), y.float()
    idx = (xf != yf).nonzero()[:6].tolist()
    return [(i, xf[tuple(i)].item(), yf[tuple(i)].item()) for i in idx] + [f"{int((xf != yf).sum())} of {xf.numel()}"]


def _candidate_check(k, q, kv, chosen, picked_by_ref):
    """The kernel's K scales (chosen [T, H]) are candidates whose score error is the least up to
    float32 rounding (kvcache/quant.py), computed here in float64; and they are mostly the very
    scales the reference picked (they may differ only on near-ties)."""
    T, H, D = k.shape
    # the candidates on k's device: CUDA torch computes amax / QMAX as amax * (1 / QMAX), like the kernel
    kf = k.float()
    scales, codes = quant.candidates(kf, quant.base_scale(kf, kv), kv)
    kf, scales, codes, qf = kf.cpu(), scales.cpu(), codes.cpu(), q.float().cpu().view(T, H, -1, D).double()
    e = codes.double() * scales.double().unsqueeze(-1) - kf.double().unsqueeze(-2)  # [T, H, N, D]
    err = (e @ qf.transpose(-1, -2)).square().sum(-1)  # [T, H, N]
    size = (e.abs() @ qf.abs().transpose(-1, -2)).square().sum(-1)  # what float32 rounding of the sums scales with
    hit = scales == chosen.cpu().unsqueeze(-1)
    assert bool(hit.any(-1).all()), "a K scale that is not one of the candidates"
    j = hit.float().argmax(-1, keepdim=True)
    best = err.min(-1).values
    slack = 1e-4 * torch.maximum(size.gather(-1, j).squeeze(-1), size.gather(-1, err.argmin(-1, keepdim=True)).squeeze(-1))
    assert bool((err.gather(-1, j).squeeze(-1) <= best + slack).all()), "a K scale whose score error is not the least"
    differ = int((chosen.cpu() != picked_by_ref.cpu()).sum())
    assert differ <= max(1, chosen.numel() // 50), f"{differ} of {chosen.numel()} K scales differ from the reference's"


def _check(T, H, D, bs, nb, in_dtype, cache_dtype, kv, device, fused_qkv=False, seed=0, group=0):
    """Reference and kernel write the same random k, v (and, with group > 0, the tokens' queries,
    group per KV head, which pick K's scales) into copies of the same pages: identical bits, but
    for K scales the kernel may pick differently on near-ties (checked by _candidate_check; its
    codes must then be the rounding of k at its own scale)."""
    g = torch.Generator().manual_seed(seed)
    q = None
    if fused_qkv:  # q, k, v as strided views of one projection output, like the engine's qkv split
        qh = max(group, 1) * H
        qkv = torch.randn(T, (qh + 2 * H) * D, generator=g).to(in_dtype)
        k = qkv[:, qh * D:(qh + H) * D].view(T, H, D)
        v = qkv[:, (qh + H) * D:].view(T, H, D)
        if group:
            q = qkv[:, :qh * D].view(T, qh, D)
    else:
        k = (torch.randn(T, H, D, generator=g) * 3).to(in_dtype)
        v = torch.randn(T, H, D, generator=g).to(in_dtype)
        if group:
            q = torch.randn(T, group * H, D, generator=g).to(in_dtype)
    if T > 2:
        k[1, 0] = 0  # an all-zero head: scale 1.0
        v[2, -1, ::2] = 0
        if q is not None:
            q[2] = 0  # every candidate's error is 0: the first (base) scale
    k, v = k.to(device), v.to(device)
    q = None if q is None else q.to(device)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(torch.int32)
    if T > 3:
        slots[0] = -1
        slots[3] = -1
    slots = slots.to(device)
    a = _caches(nb, H, bs, D, cache_dtype, kv, device)
    b = [None if x is None else x.clone() for x in a]
    ref.write_kv_cache(k, v, a[0], a[1], slots, a[2], a[3], kv, q=q)
    write_kv_cache(k, v, b[0], b[1], slots, b[2], b[3], kv, q=q)
    keep = slots >= 0
    idx = slots[keep].long()
    blk, off = idx // bs, idx % bs
    if kv and group:
        chosen, by_ref = b[2][blk, :, off], a[2][blk, :, off]  # [kept tokens, H]
        _candidate_check(k[keep], q[keep], kv, chosen, by_ref)
        if T > 8:  # the queries did move some scales off the base one
            assert bool((chosen != quant.base_scale(k[keep].float(), kv)).any())
        # the reference's pages as they are with the kernel's K scales: then every bit must agree
        a[0][blk, :, off] = quant._round(k[keep].float() / chosen.unsqueeze(-1), kv).to(a[0].dtype)
        a[2][blk, :, off] = chosen
    for x, y in zip(a, b):
        assert _same(x, y), f"mismatch for kv={kv} cache_dtype={cache_dtype}: {_diff(x, y, k, v, slots, a[2])}"


@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
@pytest.mark.parametrize("T,H,D,bs,nb", [(1, 1, 16, 16, 2), (7, 2, 32, 16, 5), (13, 3, 64, 32, 2), (5, 2, 16, 64, 1)])
def test_write_matches_reference(T, H, D, bs, nb, kv):
    _check(T, H, D, bs, nb, torch.bfloat16, torch.bfloat16, kv, DEVICE, seed=T)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("T,H,D,bs,nb", [(1, 1, 16, 16, 2), (13, 3, 64, 32, 2), (11, 2, 128, 16, 2)])
def test_write_with_queries_matches_reference(T, H, D, bs, nb, kv, group):
    _check(T, H, D, bs, nb, torch.bfloat16, torch.bfloat16, kv, DEVICE, seed=T + group, group=group)


@pytest.mark.parametrize("kv", [None, "fp8", "int8"])
def test_float32_queries_match_reference(kv):
    _check(12, 2, 32, 16, 2, torch.float32, torch.float32, kv, DEVICE, seed=5, group=2)


@pytest.mark.parametrize("in_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                  (torch.float32, torch.bfloat16)])
def test_write_float_dtypes(in_dtype, cache_dtype):
    _check(9, 2, 32, 16, 3, in_dtype, cache_dtype, None, DEVICE)


@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
@pytest.mark.parametrize("group", [0, 4])
def test_write_strided_views(kv, group):
    _check(6, 2, 32, 16, 3, torch.float16, torch.float16, kv, DEVICE, fused_qkv=True, group=group)


def test_all_slots_skipped_leaves_cache():
    k = torch.randn(4, 2, 16, device=DEVICE)
    kc, vc, _, _ = _caches(2, 2, 16, 16, torch.float32, None, DEVICE)
    before = kc.clone(), vc.clone()
    write_kv_cache(k, k, kc, vc, torch.full((4,), -1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_int8_rounds_half_to_even():
    # values that land exactly on .5 after scaling: amax 127 -> scale 1, so x itself is rounded
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4999, 126.5] + [1.0] * 7)
    k = x.view(1, 1, 16).to(DEVICE)
    kc = torch.zeros(1, 1, 16, 16, dtype=torch.int8, device=DEVICE)
    vc = kc.clone()
    ks = torch.zeros(1, 1, 16, device=DEVICE)
    vs = ks.clone()
    write_kv_cache(k, k, kc, vc, torch.tensor([0], dtype=torch.int32, device=DEVICE), ks, vs, "int8")
    assert kc[0, 0, 0].tolist() == [127, 0, 2, 2, 0, -2, -2, 3, 126] + [1] * 7
    assert ks[0, 0, 0].item() == 1.0


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_tiny_values_round_like_torch(kv):
    """Values far below the head's max round to (signed) zero exactly as the reference does."""
    x = torch.tensor([100.0, -1e-4, 1e-4, -3e-3, 3e-3, -0.11, 0.2, -0.0] + [0.5] * 8)
    k = x.view(1, 1, 16).to(DEVICE)
    kc, vc, ks, vs = _caches(1, 1, 16, 16, torch.float32, kv, DEVICE)
    a = [t.clone() for t in (kc, vc, ks, vs)]
    slots = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    ref.write_kv_cache(k, k, a[0], a[1], slots, a[2], a[3], kv)
    write_kv_cache(k, k, kc, vc, slots, ks, vs, kv)
    for x_, y_ in zip(a, (kc, vc, ks, vs)):
        assert _same(x_, y_)


@pytest.mark.parametrize("kv,group", [(None, 0), ("fp8", 0), ("fp8", 4), ("int8", 0), ("int8", 4)])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 257, 4096])
@gpu
def test_write_gpu_real_shapes(T, dtype, D, bs, kv, group):
    _check(T, 8, D, bs, T // bs + 8, dtype, dtype, kv, "cuda", seed=T + D, group=group)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("group", [1, 7])
@gpu
def test_write_gpu_query_groups(kv, group):
    """Group sizes of real models besides Llama's 4: 1 (multi-head), 7 (Qwen2.5-0.5B); fused views."""
    _check(300, 2, 64, 16, 30, torch.bfloat16, torch.bfloat16, kv, "cuda", fused_qkv=True, seed=group, group=group)
