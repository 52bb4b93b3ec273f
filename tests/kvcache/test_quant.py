"""kvcache/quant.py: the base scale, and K's scale picked among candidates by the token's own
queries (the scale convention in the module docstring)."""
from __future__ import annotations

import pytest
import torch

from kvcache import quant
from kvcache.rotation import QKRotation

QUANTIZED = ("fp8", "int8")


def keys_and_queries(seed: int = 0, tokens: int = 64, heads: int = 2, group: int = 3, dim: int = 64):
    """Rotated keys [T, H, D] and their tokens' rotated queries [T, H, G, D], with what real ones
    have: a few large channels shared by q and k, and per query head a large common direction."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, dim, generator=g)
    k[..., :4] *= 8
    u = torch.randn(heads, group, dim, generator=g)
    u[..., :4] *= 4
    q = 3 * u + torch.randn(tokens, heads, group, dim, generator=g)
    rot = QKRotation.build(dim)
    return k @ rot.r, q @ rot.r


def candidate_errors(x: torch.Tensor, q: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every candidate's scale and its own-score error, computed independently in float64."""
    base = quant.base_scale(x.float(), kv_dtype)
    scales = base.unsqueeze(-1) * torch.tensor(quant.scale_factors(kv_dtype), dtype=torch.float32)
    err = []
    for j in range(scales.shape[-1]):
        s = scales[..., j]
        codes = quant._round(x.float() / s.unsqueeze(-1), kv_dtype)
        e = codes.double() * s.double().unsqueeze(-1) - x.double()
        err.append(torch.einsum("...gd,...d->...g", q.double(), e).pow(2).sum(-1))
    return scales, torch.stack(err, -1)


def test_scale_factors_are_exact_and_start_at_one():
    for kv in QUANTIZED:
        f = quant.scale_factors(kv)
        assert len(f) == quant.NUM_CANDIDATES and f[0] == 1.0
        assert torch.equal(torch.tensor(f, dtype=torch.float32).double(), torch.tensor(f, dtype=torch.float64))
        assert all(b > a for a, b in zip(f, f[1:])) and f[-1] < 2.0


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_without_queries_the_scale_is_the_base_scale(kv_dtype):
    x, _ = keys_and_queries()
    _, scale = quant.quantize(x, kv_dtype)
    assert torch.equal(scale, x.abs().amax(-1) / quant.QMAX[kv_dtype])


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_queries_pick_the_candidate_with_the_least_score_error(kv_dtype):
    x, q = keys_and_queries(1)
    codes, scale = quant.quantize(x, kv_dtype, q)
    scales, err = candidate_errors(x, q, kv_dtype)
    j = (scales == scale.unsqueeze(-1)).float().argmax(-1)
    assert bool((scales == scale.unsqueeze(-1)).any(-1).all()), "the scale is not one of the candidates"
    chosen = err.gather(-1, j.unsqueeze(-1)).squeeze(-1)
    # float32 sums against float64 einsums: equal up to rounding
    assert bool((chosen <= err.min(-1).values * (1 + 1e-4) + 1e-9).all())
    assert bool((j > 0).any()), "no key took another scale than the base one: the search did nothing"
    # the stored values are the rounding of x at that scale
    assert torch.equal(codes.float(), quant._round(x / scale.unsqueeze(-1), kv_dtype))
    # and the token's own scores moved less than with the base scale, in total by far
    assert float(chosen.sum()) < 0.5 * float(err[..., 0].sum())


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_zero_queries_or_zero_keys_keep_the_base_scale(kv_dtype):
    x, q = keys_and_queries(2)
    _, scale = quant.quantize(x, kv_dtype, torch.zeros_like(q))  # every error 0: the first candidate
    assert torch.equal(scale, quant.base_scale(x, kv_dtype))
    z, s = quant.quantize(torch.zeros(3, 2, 16), kv_dtype, torch.randn(3, 2, 4, 16))
    assert bool((s == 1.0).all()) and bool((z.float() == 0).all())


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_round_trip_error_stays_within_the_chosen_scales_grid(kv_dtype):
    x, q = keys_and_queries(3)
    codes, scale = quant.quantize(x, kv_dtype, q)
    base = quant.base_scale(x, kv_dtype)
    assert bool((scale >= base).all()) and bool((scale < 2 * base).all())
    err = (quant.dequantize(codes, scale) - x).abs()
    s = scale.unsqueeze(-1)
    if kv_dtype == "int8":
        bound = s * 0.5
    else:  # half a step of a 3-bit mantissa, or half a subnormal step (2**-9) of the chosen scale
        bound = torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10)
    assert bool((err <= bound * (1 + 1e-5)).all())


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("group", [1, 3])
def test_later_queries_see_smaller_score_errors(kv_dtype, group):
    """The point of the search: queries of later tokens, which share the heads' large directions
    with the writing token's but are otherwise fresh draws, get scores closer to the exact ones
    (measured: 0.45-0.5x the base scale's RMS error for group 3, 0.3-0.4x for group 1)."""
    tokens, dim = 256, 64
    g = torch.Generator().manual_seed(4)
    k = torch.randn(tokens, 1, dim, generator=g)
    k[..., :4] *= 8
    u = torch.randn(group, dim, generator=g)
    u[:, :4] *= 4
    rot = QKRotation.build(dim)
    own = (3 * u + torch.randn(tokens, group, dim, generator=g)) @ rot.r
    later = (3 * u + torch.randn(64, group, dim, generator=g)) @ rot.r
    kr = k @ rot.r

    def rms_score_error(kq):
        exact = torch.einsum("qgd,td->gqt", later.double(), kr[:, 0].double())
        got = torch.einsum("qgd,td->gqt", later.double(), kq[:, 0].double())
        return float((got - exact).pow(2).mean().sqrt())

    base = rms_score_error(quant.dequantize(*quant.quantize(kr, kv_dtype)))
    chosen = rms_score_error(quant.dequantize(*quant.quantize(kr, kv_dtype, own.view(tokens, 1, group, dim))))
    assert chosen < 0.7 * base, (chosen, base)


def test_cpu_pages_are_zero_and_writable():
    from kvcache.pool import zeros

    pages = zeros((2, 3, 4), torch.bfloat16, "cpu")
    assert pages.shape == (2, 3, 4) and pages.dtype == torch.bfloat16 and not pages.any()
    pages[1, 2] = 1.5
    assert pages.sum().item() == 6.0
