"""KV pages between engine processes (prefill/decode disaggregation, scheduler/disagg.py): one
torch.distributed group over every prefill and decode engine (gloo on the CPU, NCCL on GPUs),
point-to-point sends of a sequence's blocks.

A send gathers the blocks' pages (and fp8/int8 scales) into one buffer, so the blocks may be
reused by the next step at once (it waits for the gather); the send itself runs in the background
(isend) and the buffer lives until it completes. A receive scatters the pages into the decode
engine's blocks; on a GPU the host does not wait for them (the engine's next steps do, on the
device), and CUDA events time each receive (timings()). The whole prompt moves in one batch once
it is computed: no overlap with the prefill's layers yet. Both pools must have the same page layout:
handshake() checks it, and on GPUs also sets up each pair's NCCL communicator before serving (the
first send of a pair would otherwise block until its peer joins).
"""
from __future__ import annotations

import contextlib
import datetime
import time
import zlib
from collections.abc import Sequence as Seq

import torch
import torch.distributed as dist

from engine.parallel.group import DEFAULT_TIMEOUT_S, backend_for
from kvcache.pool import KVPool


def join_group(rank: int, world_size: int, addr: str, port: int, device: torch.device,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the engines' group; rank 0 hosts its rendezvous store on `port` (picked by the server)."""
    if dist.is_initialized():
        raise RuntimeError("this engine process already belongs to a process group (tensor or pipeline parallel): "
                           "--disaggregate runs engines of one GPU each")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if device.type == "cuda":
        # no device_id (eager init of a communicator over all engines): only pairs talk, each
        # over a communicator of its own that its first send/recv sets up (handshake())
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    dist.init_process_group(backend_for(device.type), store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class PoolTransport:
    """scheduler/disagg.py's KVTransport over a KVPool and the engines' group.

    On a GPU the transfers run on a stream of their own: the send's gather must not queue behind
    the step in flight on the prefill GPU (the pages it copies were written by a step already
    collected), or the decode engine, which waits for the bytes, would wait for that step too.
    Steps launched after a send wait for its gather (the blocks it read may be reused by them);
    steps launched after a receive wait for its bytes, and it scatters them on the step stream.
    The host waited for the bytes before (2026-11-26, H100s, Llama-3-8B at 24 req/s: 1.0 ms a
    prompt, a stall of the decode engine's loop each time)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.kv = pool.kv.view(torch.uint8)  # pages as bytes: any storage dtype (fp8 included) gathers alike
        self.device = pool.kv.device
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._sending: list[tuple[list[dist.Work], list[torch.Tensor]]] = []
        self._receiving: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # bytes, start, end: not yet timed
        self._timed: list[tuple[int, float]] = []

    def _on_side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()

    def _index(self, blocks: Seq[int]) -> torch.Tensor:
        return torch.tensor(list(blocks), dtype=torch.long).to(self.device, non_blocking=True)

    def _empty(self, num_blocks: int) -> list[torch.Tensor]:
        kv, scales = self.kv, self.pool.scales
        out = [torch.empty((*kv.shape[:2], num_blocks, *kv.shape[3:]), dtype=kv.dtype, device=kv.device)]
        if scales is not None:
            out.append(torch.empty((scales.shape[0], num_blocks, *scales.shape[2:]), dtype=scales.dtype,
                                   device=scales.device))
        return out

    def send(self, blocks: list[int], peer: int, tag: int) -> int:
        self._sending = [(works, bufs) for works, bufs in self._sending if not all(w.is_completed() for w in works)]
        step_stream = torch.cuda.current_stream(self.device) if self._side is not None else None
        with self._on_side():
            idx = self._index(blocks)
            bufs = [self.kv.index_select(2, idx)]
            if self.pool.scales is not None:
                bufs.append(self.pool.scales.index_select(1, idx))
            works = [dist.isend(_bytes(b), peer, tag=tag) for b in bufs]
        if step_stream is not None:
            step_stream.wait_stream(self._side)  # later steps may write into these blocks
        self._sending.append((works, bufs))  # alive until sent
        return _nbytes(bufs)

    def recv(self, blocks: list[int], peer: int, tag: int) -> int:
        bufs = self._receive(len(blocks), peer, tag)
        step_stream = torch.cuda.current_stream(self.device) if self._side is not None else None
        if step_stream is not None:
            step_stream.wait_stream(self._side)  # the scatter and every later step: after the bytes
            for b in bufs:
                b.record_stream(step_stream)  # made on the side stream, read by the scatter below
        # on the step stream: after the step in flight, which may still touch these blocks (a
        # sequence that ended in the step before, now freed)
        idx = self._index(blocks)
        self.kv.index_copy_(2, idx, bufs[0])
        if self.pool.scales is not None:
            self.pool.scales.index_copy_(1, idx, bufs[1])
        return _nbytes(bufs)

    def discard(self, num_blocks: int, peer: int, tag: int) -> int:
        bufs = self._receive(num_blocks, peer, tag)
        return _nbytes(bufs)

    def _receive(self, num_blocks: int, peer: int, tag: int) -> list[torch.Tensor]:
        """The pages, into new buffers: on the CPU they are here on return; on a GPU the receive is
        queued on the side stream (dist.recv makes that stream, not the host, wait for NCCL's)."""
        t0 = time.perf_counter()
        with self._on_side():
            bufs = self._empty(num_blocks)
            start = torch.cuda.Event(enable_timing=True) if self._side is not None else None
            if start is not None:
                start.record()
            for b in bufs:
                dist.recv(_bytes(b), peer, tag=tag)
            n = _nbytes(bufs)
            if start is None:
                self._timed.append((n, time.perf_counter() - t0))
            else:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._receiving.append((n, start, end))
        return bufs

    def timings(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each receive done since the last call, in order; on a GPU the
        seconds run from the receive's turn on the side stream to its last byte, which includes
        any wait for the sender's gather."""
        while self._receiving and self._receiving[0][2].query():
            n, start, end = self._receiving.pop(0)
            self._timed.append((n, start.elapsed_time(end) / 1e3))
        timed, self._timed = self._timed, []
        return timed

    def handshake(self, prefill_ranks: Seq[int], decode_ranks: Seq[int], rank: int) -> None:
        """Every prefill engine sends each decode engine its page layout, in rank order (no pair
        waits on another); a decode engine whose layout differs raises."""
        mine = self.layout()
        if rank in prefill_ranks:
            for peer in decode_ranks:
                dist.send(mine, peer)
        else:
            theirs = torch.empty_like(mine)
            for peer in prefill_ranks:
                dist.recv(theirs, peer)
                if not torch.equal(theirs, mine):
                    raise RuntimeError(f"the KV pages of prefill engine {peer} ({theirs.tolist()}) differ from "
                                       f"this decode engine's ({mine.tolist()}): start both from the same flags")

    def layout(self) -> torch.Tensor:
        kv = self.pool.kv
        dims = [*kv.shape[:2], *kv.shape[3:], zlib.crc32(self.pool.spec.dtype.encode()),
                int(self.pool.scales is not None)]
        return torch.tensor(dims, dtype=torch.long, device=kv.device)


def _nbytes(bufs: list[torch.Tensor]) -> int:
    return sum(b.numel() * b.element_size() for b in bufs)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as flat bytes: gloo and NCCL take any dtype then (fp8 included)."""
    return t.reshape(-1).view(torch.uint8)
