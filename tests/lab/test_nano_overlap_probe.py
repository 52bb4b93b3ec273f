"""lab/nano_overlap_probe.py's two orders of a layer stack on the CPU: the halves, each sum on a
second stream (streams and events stood in for), give the whole batch's normed output and residual."""
from __future__ import annotations

import contextlib

import torch
from torch.nn import functional as F

from lab import nano_overlap_probe as probe


class _Event:
    def record(self, stream=None):
        pass


class _Stream:
    def wait_event(self, event):
        pass


def _add_norm(t, res, weight):  # one rank: the sum is t itself
    s = t + res
    return F.rms_norm(s, (s.shape[-1],), weight, 1e-5), s


def _silu_and_mul(x):
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def test_halves_equal_the_whole_batch(monkeypatch):
    monkeypatch.setattr(probe, "HIDDEN", 32)
    monkeypatch.setattr(probe, "ATTN", 16)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    g = torch.Generator().manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, generator=g) / k ** 0.5
    layers = [{"qkv": w(24, 32), "o": w(32, 16), "gate_up": w(80, 32), "down": w(32, 40),
               "ln1": torch.rand(32, generator=g), "ln2": torch.rand(32, generator=g)} for _ in range(3)]
    x, residual = torch.randn(10, 32, generator=g), torch.randn(10, 32, generator=g)
    want = probe.whole(x, residual, layers, _add_norm, _silu_and_mul)
    got = probe.halves(x, residual, layers, _add_norm, _silu_and_mul, _Stream())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # a layer that skipped its sum would not match
    broken = probe.halves(x, residual, layers, lambda t, r, wt: (t, r), _silu_and_mul, _Stream())
    assert not torch.allclose(broken[0], want[0])
