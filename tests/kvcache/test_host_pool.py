"""The host tier's copies (CPU): blocks round-trip bit for bit, scales included, in the order the
moves promise (copy-outs, then copy-ins, then the write-ahead)."""
from __future__ import annotations

import pytest
import torch

from kvcache.host_pool import HostKVPool, KVCopier, _runs
from kvcache.pool import KVPool
from kvcache.spec import KVCacheSpec


def pool_of(dtype: str) -> KVPool:
    pool = KVPool(KVCacheSpec(2, 2, 8, 4, dtype), 6, "cpu")
    g = torch.Generator().manual_seed(0)
    pool.kv.view(torch.uint8).copy_(torch.randint(0, 120, pool.kv.view(torch.uint8).shape, generator=g))
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=g))
    return pool


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "int8"])
def test_round_trip(dtype):
    pool = pool_of(dtype)
    copier = KVCopier(pool, HostKVPool(pool, 5, pin=False))
    before = pool.kv.view(torch.uint8).clone()
    scales = None if pool.scales is None else pool.scales.clone()
    copier.apply([(1, 3), (4, 0)], [])
    pool.kv.zero_()
    if pool.scales is not None:
        pool.scales.zero_()
    copier.apply([], [(3, 2), (0, 5)])  # block 1's copy into block 2, block 4's into block 5
    after = pool.kv.view(torch.uint8)
    assert torch.equal(after[:, :, 2], before[:, :, 1]) and torch.equal(after[:, :, 5], before[:, :, 4])
    if scales is not None:
        assert torch.equal(pool.scales[:, 2], scales[:, 1]) and torch.equal(pool.scales[:, 5], scales[:, 4])
    assert copier.bytes_out == copier.bytes_in == 2 * pool.spec.bytes_per_block


def test_outs_before_ins_and_ahead_last():
    pool = pool_of("bfloat16")
    copier = KVCopier(pool, HostKVPool(pool, 4, pin=False))
    dev, host = pool.kv.view(torch.uint8), copier.host.kv.view(torch.uint8)  # bytes: random bits hold NaNs
    before = dev.clone()
    # block 0 is saved to slot 1 and refilled from slot 1 in the same step: it gets itself back; the
    # write-ahead of block 3 runs after the copy-in into it, so slot 0 holds block 2's bytes
    copier.apply([(0, 1), (2, 2)], [(1, 0), (2, 3)], [(3, 0)])
    assert torch.equal(dev[:, :, 0], before[:, :, 0]) and torch.equal(dev[:, :, 3], before[:, :, 2])
    assert torch.equal(host[0], before[:, :, 2]) and torch.equal(host[1], before[:, :, 0])


def test_runs():
    assert _runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]
