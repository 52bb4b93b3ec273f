"""kernels/launch.py: the fast launch path's cache key and, on the GPU, its launches."""
from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from kernels import fused, launch
from kernels.reference import rms_norm as ref_rms_norm
from tests.kernels.util import gpu


def _scale(x_ptr, out_ptr, n, stride, factor, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i * stride, mask=i < n)
    tl.store(out_ptr + i, x * factor, mask=i < n)


def _kernel(**spec) -> launch._Kernel:
    # a JITFunction built directly, so that it is one even under TRITON_INTERPRET=1 (CPU CI)
    return launch._Kernel(JITFunction(_scale, **spec))


def test_key_separates_what_triton_specializes():
    k = _kernel()
    x = torch.randn(64)
    out = torch.empty(64)
    base = k.key([x, out, 40, 1, 2.0, 64])
    assert base == k.key([x.clone(), torch.empty(64), 56, 1, 3.5, 64])  # same alignment and divisibility
    assert base != k.key([x[1:], out, 40, 1, 2.0, 64])  # a 4-byte offset: not 16-byte aligned
    assert base != k.key([x.double(), out, 40, 1, 2.0, 64])  # dtype
    assert base != k.key([x, out, 32, 1, 2.0, 64])  # 32 is divisible by 16, 40 is not
    assert base != k.key([x, out, 40, 2, 2.0, 64])  # 1 is specialized on
    assert base != k.key([x, out, 1 << 40, 1, 2.0, 64])  # an int64 argument
    assert base != k.key([x, out, 40, 1, 2.0, 128])  # a constexpr
    assert k.key([x, out, 40, 1, "fast", 64]) is None  # an unknown kind: the normal path decides


def test_key_honours_do_not_specialize():
    k = _kernel(do_not_specialize=["n"], do_not_specialize_on_alignment=["x_ptr"])
    x = torch.randn(64)
    out = torch.empty(64)
    assert k.key([x, out, 40, 1, 2.0, 64]) == k.key([x[1:], out, 32, 1, 2.0, 64])
    assert k.key([x, out, 40, 1, 2.0, 64]) != k.key([x, out[1:], 40, 1, 2.0, 64])


@gpu
def test_fast_launches_match_the_normal_path(monkeypatch):
    """Repeated launches take the fast path and compute what the first (normal) launch did, across
    aligned and misaligned views; CHECK asserts Triton would have picked the same kernel."""
    monkeypatch.setattr(launch, "CHECK", True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    before = launch.stats().get("_rms_norm_kernel", (0, 0))[1]
    for _ in range(3):
        for offset in (0, 1, 8):
            x = torch.randn(37 * 4096 + 8, device="cuda", dtype=torch.bfloat16, generator=gen)[offset:offset + 37 * 4096]
            x = x.view(37, 4096)
            got = fused.rms_norm(x, w, 1e-6)
            torch.testing.assert_close(got, ref_rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1.6e-2)
    assert launch.stats()["_rms_norm_kernel"][1] >= before + 6


@gpu
def test_compile_ahead_compiles_without_launching():
    """Inside compile_ahead(), a new specialization is compiled on a thread and not run (its output
    keeps what it held); after it, the launch runs the compiled kernel without compiling again."""
    fn = JITFunction(_scale)  # a fresh function: nothing of it compiled in this process
    x = torch.randn(100, device="cuda")
    out = torch.full((100,), -1.0, device="cuda")
    with launch.compile_ahead(threads=2) as compiled:
        launch.launch(fn, (1,), x, out, 100, 1, 3.0, BLOCK=128)
        launch.launch(fn, (1,), x, out, 100, 1, 3.0, BLOCK=128)  # the same key: submitted once
        launch.launch(fn, (1,), x, out, 100, 1, 3.0, BLOCK=256)
    assert compiled == [2]
    torch.cuda.synchronize()
    assert bool((out == -1).all())  # nothing ran
    device = torch.cuda.current_device()
    assert len(fn.device_caches[device][0]) == 2  # both variants sit in Triton's in-memory cache
    launch.launch(fn, (1,), x, out, 100, 1, 3.0, BLOCK=128)
    torch.testing.assert_close(out, x * 3.0)
    assert len(fn.device_caches[device][0]) == 2


def test_separate_arrival_counters_starts_a_new_set_and_keeps_the_old():
    """Graphs that will run at once each get counters of their own; the set an earlier graph
    captured stays alive (its address is in the graph)."""
    dev = torch.device("cpu")
    first = launch.arrival_counters(dev, 16)
    launch.separate_arrival_counters(dev)
    second = launch.arrival_counters(dev, 16)
    assert second.data_ptr() != first.data_ptr() and second.numel() == first.numel()
    assert any(t is first for t in launch._COUNTERS[dev])
    assert launch.arrival_counters(dev, 16) is second
