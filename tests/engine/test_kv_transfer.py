"""engine/kv_transfer.py between two processes, on the CPU (gloo, memory files) and on two GPUs
(NCCL, CUDA IPC; marked gpu): a prefill side sends some of its pool's blocks (pages and, for int8,
scales) and a decode side receives them into other block ids, or the decode side maps the prefill's
pool and copies them itself, also after the prefill process was killed; a drained transfer leaves
the pool alone; each receive and copy is timed once; a pool of another layout fails the handshake."""
from __future__ import annotations

import os
import signal
import socket

import pytest
import torch
import torch.multiprocessing as mp

from kvcache.pool import KVPool
from kvcache.spec import KVCacheSpec

SENT, INTO = [3, 1, 4], [0, 5, 2]
TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes (random bytes read as floats include NaNs, which equal nothing)."""
    return t.contiguous().view(torch.uint8)


def _pool(dtype: str, seed: int, heads: int = 2, device: str = "cpu") -> KVPool:
    pool = KVPool(KVCacheSpec(2, heads, 8, 4, dtype), 6, device)
    g = torch.Generator().manual_seed(seed)
    pool.kv.view(torch.uint8).copy_(torch.randint(0, 256, pool.kv.view(torch.uint8).shape, generator=g,
                                                  dtype=torch.uint8))
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=g))
    return pool


def _side(rank: int, port: int, out: dict, device_type: str) -> None:
    from engine.kv_transfer import PoolTransport, join_group, leave_group

    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    join_group(rank, 2, "127.0.0.1", port, device, timeout_s=60)
    # a decode pool of one KV head against a prefill pool of two
    try:
        PoolTransport(_pool("float32", seed=rank, heads=2 - rank, device=str(device))).handshake([0], [1], rank)
        out[("handshake", rank)] = "passed"
    except RuntimeError as e:
        out[("handshake", rank)] = str(e)
    for tag, dtype in enumerate(("float32", "int8")):
        pool = _pool(dtype, seed=rank, device=str(device))
        transport = PoolTransport(pool)
        transport.handshake([0], [1], rank, pull=False)
        assert not transport.lends_to(1)
        if rank == 0:
            transport.send(SENT, 1, tag=2 * tag)
            transport.send(SENT[:1], 1, tag=2 * tag + 1)
            for works, _ in transport._sending:
                for w in works:
                    w.wait()
            scales = None if pool.scales is None else pool.scales[:, SENT].cpu()
            out[(dtype, rank)] = (pool.kv[:, :, SENT].cpu(), scales)
        else:
            before = pool.kv.clone()
            n = transport.recv(INTO, 0, tag=2 * tag)
            dropped = transport.discard(1, 0, tag=2 * tag + 1)
            if device.type == "cuda":  # the receives were queued, not waited for
                torch.cuda.synchronize(device)
            timed = transport.timings()
            untouched = [b for b in range(6) if b not in INTO]
            scales = None if pool.scales is None else pool.scales[:, INTO].cpu()
            out[(dtype, rank)] = (pool.kv[:, :, INTO].cpu(), scales, n,
                                  torch.equal(_raw(pool.kv[:, :, untouched]), _raw(before[:, :, untouched])))
            out[("timed", dtype)] = (timed, [n, dropped], transport.timings())
    leave_group()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def exchanged(request) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = _free_port()
    procs = [ctx.Process(target=_side, args=(r, port, out, request.param)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    return dict(out)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_blocks_arrive_in_other_block_ids(exchanged, dtype):
    kv, scales = exchanged[(dtype, 0)]
    got_kv, got_scales, n, untouched = exchanged[(dtype, 1)]
    assert torch.equal(_raw(got_kv), _raw(kv)) and untouched
    if dtype == "int8":
        assert torch.equal(got_scales, scales)
    assert n == kv.numel() * kv.element_size() + (0 if scales is None else scales.numel() * 4)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_each_receive_is_timed_once(exchanged, dtype):
    timed, sizes, again = exchanged[("timed", dtype)]
    assert [n for n, _ in timed] == sizes and all(s >= 0 for _, s in timed) and again == []


def test_a_pool_of_another_layout_fails_the_handshake(exchanged):
    assert exchanged[("handshake", 0)] == "passed"
    assert "start both from the same flags" in exchanged[("handshake", 1)]


def _pull_side(rank: int, port: int, out: dict, device_type: str, killed) -> None:
    """Rank 0 lends its pool and is killed; rank 1 copies blocks from it before and after."""
    from engine.kv_transfer import PoolTransport, join_group

    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    join_group(rank, 2, "127.0.0.1", port, device, timeout_s=60)
    pool = _pool("int8", seed=rank, device=str(device))
    transport = PoolTransport(pool)
    transport.handshake([0], [1], rank)
    if rank == 0:
        out["lends"] = transport.lends_to(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["exported"] = True
        while True:  # until the test kills this process
            signal.pause()
    before = pool.kv.clone()
    got = []
    for tag, into in ((1, INTO), (2, [4, 3, 1])):
        if tag == 2:
            killed.wait(60)
        n = transport.pull(into, 0, SENT, tag)
        landed = transport.copied(tag)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        got.append((pool.kv[:, :, into].cpu(), pool.scales[:, into].cpu(), n, landed or transport.copied(tag)))
    untouched = [b for b in range(6) if b not in INTO + [4, 3, 1]]
    out["pulled"] = (got, torch.equal(_raw(pool.kv[:, :, untouched]), _raw(before[:, :, untouched])),
                     transport.timings())
    os._exit(0)  # the group's store lived in the killed process: no orderly leave


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def pulled(request) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    killed = ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_pull_side, args=(r, port, out, request.param, killed)) for r in (0, 1)]
    for p in procs:
        p.start()
    for _ in range(1200):
        if "exported" in out or not procs[0].is_alive():
            break
        procs[0].join(0.05)
    procs[0].kill()
    procs[0].join(30)
    killed.set()
    procs[1].join(120)
    assert procs[0].exitcode == -signal.SIGKILL and procs[1].exitcode == 0
    return dict(out)


def test_the_decode_side_copies_lent_blocks_also_after_the_prefill_process_died(pulled):
    want = _pool("int8", seed=0)
    got, untouched, timed = pulled["pulled"]
    assert pulled["lends"] and untouched
    for kv, scales, n, landed in got:
        assert torch.equal(_raw(kv), _raw(want.kv[:, :, SENT])) and torch.equal(scales, want.scales[:, SENT])
        assert n == kv.numel() * kv.element_size() + scales.numel() * 4 and landed
    assert [n for n, _ in timed] == [got[0][2], got[1][2]] and all(t >= 0 for _, t in timed)
