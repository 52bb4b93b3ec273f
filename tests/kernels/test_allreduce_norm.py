"""The fused all-reduce + residual add + RMSNorm kernel against kernels/fused.py's rms_norm, which
the unfused path runs after the all-reduce: on one rank (no peers: the sum is the rank's own rows),
and, under the interpreter, on 2 and 3 ranks played by forked processes that share their buffers;
rows beyond the program count go round the programs, and each call moves the programs' epochs on
and switches halves. Its exchanges between GPUs are tested on two of them
(tests/engine/test_peer_allreduce.py)."""
import multiprocessing as mp
import traceback

import pytest
import torch

from kernels import fused
from kernels import allreduce_norm as arn
from kernels.allreduce_norm import allreduce_add_norm, flag_bytes, row_bytes
from tests.kernels.util import DEVICE, HAS_CUDA


def test_flags_hold_ready_per_program_and_rank_then_epochs():
    assert flag_bytes(3, 2) == 256 and flag_bytes(132, 2) == 1792 and flag_bytes(132, 4) == 2816


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,programs", [(5, 96, 4), (1, 1000, 8), (9, 64, 2)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("push_max_bytes", [0, 1 << 20], ids=["read", "push"])
def test_one_rank_equals_the_norm(rows, hidden, programs, dtype, with_residual, push_max_bytes, monkeypatch):
    monkeypatch.setattr(arn, "PUSH_MAX_BYTES", push_max_bytes)
    g = torch.Generator().manual_seed(rows)
    flags, half = flag_bytes(programs, 1), rows * hidden * dtype.itemsize
    buf = torch.zeros(flags + row_bytes(half, 1), dtype=torch.uint8, device=DEVICE)
    flag_ptrs = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=DEVICE)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    for call in range(3):
        x = (torch.randn(rows, hidden, generator=g) * 4).to(dtype).to(DEVICE)
        r = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE) if with_residual else None
        got, res = allreduce_add_norm(x, r, w, 1e-6, flag_ptrs + flags, flag_ptrs, 0, programs, half)
        want, want_res = fused.rms_norm(x, w, 1e-6, r) if with_residual else (fused.rms_norm(x, w, 1e-6), x)
        assert torch.equal(res, want_res)
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1.6e-2, rtol=1e-5)
        epochs = buf[:flags].view(torch.int32)[programs:2 * programs]
        assert epochs[:min(rows, programs)].tolist() == [call + 1] * min(rows, programs)
        assert not epochs[rows:].any()  # programs beyond the rows were not launched
        if not push_max_bytes:  # read by the peers: this call's rows, in the half of its epoch's parity
            written = buf[flags + (call + 1) % 2 * half:][:half].view(dtype).view(rows, hidden)
            assert torch.equal(written, x)


def _play_rank(rank: int, bufs: list, flags: int, slot: int, programs: int, xs, rs, w, outs, res_outs) -> None:
    """One rank's calls (a forked child: the parent's shared tensors sit at the same addresses)."""
    flag_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    for call in range(xs.shape[0]):
        n = 1 if call % 2 else xs.shape[2]  # rows this call
        r = rs[call, :n] if rs is not None else None
        got, res = allreduce_add_norm(xs[call, rank, :n], r, w, 1e-6, flag_ptrs + flags, flag_ptrs, rank,
                                      programs, slot)
        outs[call, rank, :n].copy_(got)
        res_outs[call, rank, :n].copy_(res)


def _exchange(world: int, rows: int, programs: int, with_residual: bool, push_max_bytes: int | None,
              hidden: int = 64, dtype: torch.dtype = torch.bfloat16) -> None:
    """The ranks' calls, forked from this process, checked against torch (raises if they differ):
    float32 exactly (the interpreter runs the norm kernel the same way), bf16 within an ulp."""
    calls = 4
    if push_max_bytes is None:  # calls of 1 row or `rows` rows by turns: the second over the limit
        push_max_bytes = hidden * dtype.itemsize
    arn.PUSH_MAX_BYTES = push_max_bytes  # this process's own module: it is a test's helper
    g = torch.Generator().manual_seed(world * 10 + rows)
    flags, slot = flag_bytes(programs, world), rows * hidden * dtype.itemsize
    bufs = [torch.zeros(flags + row_bytes(slot, world), dtype=torch.uint8).share_memory_() for _ in range(world)]
    xs = (torch.randn(calls, world, rows, hidden, generator=g) * 4).to(dtype)
    # zeros of both signs: a pushed +0.0 must not pass for a row not yet arrived (the readers would hang)
    xs[..., ::7] = 0.0
    xs[..., 3::11] = -0.0
    # the residual stream is the same on every rank
    rs = torch.randn(calls, rows, hidden, generator=g).to(dtype) if with_residual else None
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    outs, res_outs = (torch.zeros(calls, world, rows, hidden, dtype=dtype).share_memory_() for _ in range(2))
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_play_rank, args=(rank, bufs, flags, slot, programs, xs, rs, w, outs, res_outs))
             for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank waited forever for a peer's flag or rows"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for buf in bufs:  # every pushed row was zeroed again after it was read
        assert not buf[flags + 2 * arn.slots(world) * slot:].any()
    for call in range(calls):
        n = 1 if call % 2 else rows
        total = sum(xs[call, s, :n].float() for s in range(world)).to(dtype)  # rank order, rounded once
        r = rs[call, :n] if with_residual else None
        if with_residual:
            want, want_res = fused.rms_norm(total, w, 1e-6, r)
        else:
            want, want_res = fused.rms_norm(total, w, 1e-6), total
        for rank in range(world):
            if dtype == torch.float32:
                assert torch.equal(res_outs[call, rank, :n], want_res) and torch.equal(outs[call, rank, :n], want)
            torch.testing.assert_close(res_outs[call, rank, :n], want_res, atol=0.1, rtol=1.6e-2)
            torch.testing.assert_close(outs[call, rank, :n], want, atol=0.1, rtol=1.6e-2)
            assert torch.equal(outs[call, rank], outs[call, 0])
            assert torch.equal(res_outs[call, rank], res_outs[call, 0])


def _exchange_reporting(queue, *args) -> None:
    try:
        _exchange(*args)
        queue.put(None)
    except BaseException:
        queue.put(traceback.format_exc())


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors run under the interpreter only; GPUs: test_peer_allreduce")
@pytest.mark.parametrize("world,rows,programs", [(2, 5, 2), (3, 3, 4)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("push_max_bytes", [0, 1 << 20, None], ids=["read", "push", "both"])
def test_ranks_exchange_rows_and_agree(world, rows, programs, with_residual, push_max_bytes, extra=()):
    """Every rank gets the norm of the sum in rank order, bit for bit the same, over calls that
    reuse both halves; a rank that waited on a flag never set, or on pushed rows it took for not yet
    arrived, would hang (joined with a timeout).
    The interpreter rounds float32 to bf16 toward zero (the GPU to nearest): one ulp's tolerance
    against torch. Rows are read from the peers' memory, pushed into it, or (both) pushed for the
    small calls and read for the large, one after the other.

    The ranks are forked (so that their shared buffers sit at the same addresses in each) from a
    forkserver's child, never from pytest's own process: a fork of a process that other tests left
    threads in (tokenizers, gloo) once crashed a rank in its garbage collector."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    queue = ctx.Queue()
    helper = ctx.Process(target=_exchange_reporting, args=(queue, world, rows, programs, with_residual, push_max_bytes, *extra))
    helper.start()
    try:
        failure = queue.get(timeout=300)
    finally:
        helper.join(timeout=60)
        if helper.is_alive():
            helper.kill()
    assert failure is None, failure


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors run under the interpreter only; GPUs: test_peer_allreduce")
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("push_max_bytes", [0, 1 << 20], ids=["read", "push"])
def test_float32_rows_narrower_than_the_block_exchange_exactly(with_residual, push_max_bytes):
    """48 columns in a 64-wide block: the masked columns add nothing to the norm's sum of squares,
    whichever way the rows came (the norm kernel's float32 result, bit for bit)."""
    test_ranks_exchange_rows_and_agree(2, 3, 2, with_residual, push_max_bytes, extra=(48, torch.float32))
