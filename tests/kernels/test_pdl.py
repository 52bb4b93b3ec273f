"""Programmatic dependent launch (kernels/pdl.py): the kernels compile for sm_90 with the wait in
front of every memory access (CPU), and a decode layer's chain of kernels gives bitwise the same
results with and without PDL, eagerly and replayed from a CUDA graph (GPU)."""
from __future__ import annotations

import json

import pytest
import torch

from engine.runner import select_ops
from kernels import fused, linear, paged_attention
from tests.kernels.util import HAS_CUDA, gpu, make_cache, run_outside_interpreter


def test_decode_kernels_compile_for_sm90_with_the_wait_first():
    """Triton's own ptxas builds the H100 variants without a GPU (tests/kernels/sm90_compile.py)."""
    out = run_outside_interpreter(["-m", "tests.kernels.sm90_compile"], timeout=600)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    matmuls = {"_skinny_kernel", "_gate_up_kernel"}
    assert {r["kernel"] for r in rows} == matmuls | {"_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel",
                                                     "_write_kv_kernel", "_decode_kernel", "_quantize_kernel",
                                                     "_w8a8_kernel", "_w4a16_kernel", "_dequantize_kernel",
                                                     "_w4a16_wgmma_kernel", "_gather_columns_kernel"}
    for r in rows:
        assert r["launch_pdl"] and r["wait"] and r["launch_dependents"] and r["writes_after_wait"], r
        # Hopper's W4A16 kernel loads its first weight words, the column gather its order (which no
        # kernel writes) before the wait
        assert r["memory_after_wait"] == (r["kernel"] not in ("_w4a16_wgmma_kernel", "_gather_columns_kernel")), r
        # only the matmuls touch memory (their weights, into L2) before the wait
        assert r["prefetch_before_wait"] == (r["kernel"] in matmuls), r


def test_pdl_needs_the_triton_kernels_on_a_gpu():
    with pytest.raises(ValueError, match="Triton kernels on a CUDA GPU"):
        select_ops(torch.device("cpu"), "auto", pdl=True)
    with pytest.raises(ValueError, match="Triton kernels on a CUDA GPU"):
        select_ops(torch.device("cuda"), "torch", pdl=True)


def test_pdl_by_default_only_where_the_device_can():
    assert select_ops(torch.device("cpu"), "auto")[1] is False  # the torch reference
    assert select_ops(torch.device("cpu"), "triton")[1] is False  # the interpreter has no PDL
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        select_ops(torch.device("cpu"), "triton", pdl=True)
    if HAS_CUDA:
        major, _ = torch.cuda.get_device_capability()
        assert select_ops(torch.device("cuda"), "auto")[1] is (major >= 9)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors run under the interpreter only")
def test_pdl_is_ignored_for_cpu_tensors():
    """Under the interpreter (CPU tensors) the wrappers launch without PDL: same results."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 128, generator=g).to(torch.bfloat16)
    assert torch.equal(linear.skinny_linear(x, w, pdl=True), linear.skinny_linear(x, w))


def _layer(x, res, p, kc, vc, bt, sl, slots, positions, cos_sin, pdl):
    """A Qwen2.5-0.5B-shaped decode layer, with the engine's kernels in the engine's order."""
    h, res = fused.rms_norm(x, p["ln1"], 1e-6, res, pdl=pdl)
    qkv = linear.skinny_linear(h, p["qkv"], p["qkv_b"], pdl=pdl)
    q, k, v = qkv.split([896, 128, 128], dim=-1)
    q, k, v = q.view(-1, 14, 64), k.view(-1, 2, 64), v.view(-1, 2, 64)
    fused.apply_rotary(q, k, positions, cos_sin, v, kc, vc, slots, pdl=pdl)
    o = paged_attention.paged_decode_attention(q, kc, vc, bt, sl, 0.125, pdl=pdl, config={"num_splits": 4})
    h = linear.skinny_linear(o.view(-1, 896), p["o"], pdl=pdl)
    h, res = fused.rms_norm(h, p["ln2"], 1e-6, res, pdl=pdl)
    gu = torch.nn.functional.linear(h, p["gate_up"])  # cuBLAS, launched without PDL, as in the engine
    return linear.skinny_linear(fused.silu_and_mul(gu, pdl=pdl), p["down"], pdl=pdl), res


@gpu
@pytest.mark.parametrize("batch", [1, 13, 64])
def test_decode_layer_with_pdl_is_bitwise_equal(batch):
    g = torch.Generator().manual_seed(batch)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(bf).cuda()

    p = {"ln1": rnd(896), "ln2": rnd(896), "qkv": rnd(1152, 896, scale=0.03), "qkv_b": rnd(1152),
         "o": rnd(896, 896, scale=0.03), "gate_up": rnd(9728, 896, scale=0.03), "down": rnd(896, 4864, scale=0.02)}
    kc, vc, _, _ = make_cache(batch * 48, 2, 16, 64, bf, None, "cuda", gen=g)
    bt = torch.randperm(batch * 48, generator=g).to(torch.int32).view(batch, 48).cuda()
    cos_sin = torch.randn(1024, 2, 64, generator=g).cuda()

    def inputs(step):
        sl = torch.randint(1, 700, (batch,), generator=g, dtype=torch.int32).cuda()
        pos = (sl - 1).long()
        slots = (bt.gather(1, (pos // 16).view(-1, 1)).view(-1).long() * 16 + pos % 16)
        return rnd(batch, 896), rnd(batch, 896), sl, slots, pos

    def run(pdl, ins, caches):
        x, res, sl, slots, pos = ins
        return _layer(x, res, p, *caches, bt, sl, slots, pos, cos_sin, pdl)

    for pdl in (False, True):  # compile and allocate the arrival counters eagerly
        run(pdl, inputs(0), (kc.clone(), vc.clone()))
    static = inputs(0)
    caches = {pdl: (kc.clone(), vc.clone()) for pdl in (False, True)}
    graphs, outs = {}, {}
    for pdl in (False, True):
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            outs[pdl] = run(pdl, static, caches[pdl])
    for step in range(5):
        new = inputs(step + 1)
        for s, n in zip(static, new):
            s.copy_(n)
        eager_caches = (caches[False][0].clone(), caches[False][1].clone())
        for pdl in (False, True):
            graphs[pdl].replay()
        eager = run(True, new, eager_caches)
        torch.cuda.synchronize()
        for a, b, c in zip(outs[False], outs[True], eager):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert torch.equal(caches[False][0], caches[True][0]) and torch.equal(caches[False][1], caches[True][1])
        assert torch.equal(caches[False][0], eager_caches[0])
