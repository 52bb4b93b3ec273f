"""KV pages between engine processes (prefill/decode disaggregation, scheduler/disagg.py).

Two ways, chosen per pair of engines when they meet (handshake()):
- pull: the decode engine maps the prefill engine's whole pool once (CUDA IPC on GPUs of one host,
  the pool's memory file on the CPU) and copies a sequence's pages itself, from the prefill's
  block ids into its own, on its step stream: later steps are ordered after the copy, and the
  prefill engine keeps the blocks until the server tells it the copy has landed (copied()). No
  collective waits on the other process: a prefill engine that dies leaves pages already written
  (its mapping outlives it), never a receive that waits for bytes that will not come.
- push, where a pool cannot be mapped: one torch.distributed group over every prefill and decode
  engine (gloo on the CPU, NCCL on GPUs), point-to-point sends. A send gathers the blocks' pages
  (and fp8/int8 scales) into one buffer, so the blocks may be reused by the next step at once; the
  send runs in the background (isend) and the buffer lives until it completes. A receive scatters
  the pages into the decode engine's blocks; on a GPU the host does not wait for them (the engine's
  next steps do, on the device). handshake() sets up each push pair's NCCL communicator before
  serving (the first send of a pair would otherwise block until its peer joins).
CUDA events time each pull and receive (timings()). Both pools must have the same page layout:
handshake() checks it. The whole prompt moves in one batch once it is computed: no overlap with
the prefill's layers.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import mmap
import os
import pickle
import time
import zlib
from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.group import DEFAULT_TIMEOUT_S, backend_for
from kernels import reference
from kernels.copy_pages import copy_pages
from kvcache.pool import KVPool, mapped

log = logging.getLogger("pagedserve")


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

    Push on a GPU runs on a stream of its own: the send's gather must not queue behind the step in
    flight on the prefill GPU (the pages it copies were written by a step already collected), or
    the decode engine, which waits for the bytes, would wait for that step too. Steps launched
    after a send wait for its gather (the blocks it read may be reused by them); steps launched
    after a receive wait for its bytes, and it scatters them on the step stream. A pull copies on
    the step stream: after the step in flight, which may still read the blocks it writes (those
    of a sequence that ended in the step before, now freed). The host waited for the bytes once
    (2026-11-26, H100s, Llama-3-8B at 24 req/s: 1.0 ms a prompt, a stall of the decode engine's
    loop each time)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.kv = pool.kv.view(torch.uint8)  # pages as bytes: any storage dtype (fp8 included) gathers alike
        self.device = pool.kv.device
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._sending: list[tuple[list[dist.Work], list[torch.Tensor]]] = []
        self._receiving: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # bytes, start, end: not yet timed
        self._timed: list[tuple[int, float]] = []
        self._words = page_words(pool.kv, pool.scales)  # this pool's pages, block id at dim 1
        self._peers: dict[int, list[torch.Tensor]] = {}  # a prefill engine's pages, mapped here: this engine pulls
        self._lends: set[int] = set()  # the decode engines that pull from this pool
        self._landing: dict[int, torch.cuda.Event] = {}  # tag -> the end of a pull still on its way

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

    # -- pull ------------------------------------------------------------------------------

    def lends_to(self, peer: int) -> bool:
        return peer in self._lends

    def pull(self, blocks: list[int], peer: int, src_blocks: list[int], tag: int) -> int:
        """Copy blocks src_blocks of prefill engine `peer`'s pool into `blocks` of this one; on a
        GPU the copy is queued on the step stream (copied(tag) tells when it has landed)."""
        clock = self._clock()
        n = self._copy(peer, src_blocks, blocks)
        end = self._clocked(n, clock)
        if end is not None:
            self._landing[tag] = end
        return n

    def _copy(self, peer: int, src_blocks: list[int], blocks: list[int]) -> int:
        src_idx, dst_idx = self._index(src_blocks), self._index(blocks)
        copy = copy_pages if self.device.type == "cuda" else reference.copy_pages
        for mine, theirs in zip(self._words, self._peers[peer]):
            copy(theirs, mine, src_idx, dst_idx)
        return sum(len(blocks) * w.shape[0] * w.shape[2] * w.element_size() for w in self._words)

    def copied(self, tag: int) -> bool:
        """Whether the pull of `tag` has landed: the prefill engine may reuse its blocks then."""
        end = self._landing.get(tag)
        if end is None or end.query():
            self._landing.pop(tag, None)
            return True
        return False

    # -- push ------------------------------------------------------------------------------

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
        with self._on_side():
            bufs = self._empty(num_blocks)
            clock = self._clock()
            for b in bufs:
                dist.recv(_bytes(b), peer, tag=tag)
            self._clocked(_nbytes(bufs), clock)
        return bufs

    def _clock(self) -> tuple[float, torch.cuda.Event | None]:
        """The start of a move: the host's clock, and on a GPU an event on the current stream."""
        start = torch.cuda.Event(enable_timing=True) if self._side is not None else None
        if start is not None:
            start.record()
        return time.perf_counter(), start

    def _clocked(self, nbytes: int, clock: tuple[float, torch.cuda.Event | None]) -> torch.cuda.Event | None:
        """The end of a move of nbytes begun at clock: timed now on the CPU; on a GPU its end event,
        which timings() reads once it has passed."""
        t0, start = clock
        if start is None:
            self._timed.append((nbytes, time.perf_counter() - t0))
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._receiving.append((nbytes, start, end))
        return end

    def timings(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each pull and receive done since the last call, in order; on a GPU
        the seconds run from its turn on its stream to its last byte, which includes, for a
        receive, any wait for the sender's gather."""
        while self._receiving and self._receiving[0][2].query():
            n, start, end = self._receiving.pop(0)
            self._timed.append((n, start.elapsed_time(end) / 1e3))
        timed, self._timed = self._timed, []
        return timed

    # -- meeting ---------------------------------------------------------------------------

    def handshake(self, prefill_ranks: Seq[int], decode_ranks: Seq[int], rank: int, pull: bool = True) -> None:
        """Every prefill engine publishes its page layout and a handle to its pages in the group's
        store; each decode engine checks the layout (it raises where they differ) and maps the
        pages, or answers "push" where it cannot (or `pull` is off). Then, where some pair does
        not pull, the push pairs set up their communicators, in rank order (no pair waits on
        another); where every pair pulls, every engine leaves the group (nothing is sent, and no
        engine keeps watching the store that rank 0 hosts: it may die before the others)."""
        # each rank's n-th handshake pairs with every other rank's n-th; the keys carry n, and a
        # key with one reader is deleted by it
        store = dist.distributed_c10d._get_default_store()
        n = store.add(f"kv-handshakes/{rank}", 1)
        world = sorted({*prefill_ranks, *decode_ranks})
        mine = self.layout()
        push: list[int] = []
        apart = 0  # pairs that do not pull
        refused: RuntimeError | None = None
        if rank in prefill_ranks:
            handle = None
            if pull:
                try:
                    handle = export_pages(self.pool)
                except Exception as e:  # the decode engines ask for sends then
                    log.info("prefill engine %d cannot share its KV pages (%s): they move by point-to-point "
                             "sends", rank, e)
            offer = pickle.dumps((mine, handle))
            for peer in decode_ranks:
                store.set(f"kv-pages/{n}/{rank}/{peer}", offer)
            for peer in decode_ranks:
                key = f"kv-way/{n}/{rank}/{peer}"
                way = store.get(key)
                store.delete_key(key)
                if way == b"pull":
                    self._lends.add(peer)
                else:
                    apart += 1
                    if way == b"push":
                        push.append(peer)
        else:
            for peer in prefill_ranks:
                offer = f"kv-pages/{n}/{peer}/{rank}"
                theirs, handle = pickle.loads(store.get(offer))
                store.delete_key(offer)
                key = f"kv-way/{n}/{peer}/{rank}"
                if theirs != mine:
                    store.set(key, b"refused")
                    apart += 1
                    refused = refused or RuntimeError(
                        f"the KV pages of prefill engine {peer} ({theirs}) differ from this decode engine's "
                        f"({mine}): start both from the same flags")
                    continue
                try:
                    if handle is None:
                        raise RuntimeError("pulling is off")
                    self._peers[peer] = page_words(*map_pages(handle, self.device))
                    self._copy(peer, [0], [0])  # compiles the copy now, not in the first prompt's pull
                    store.set(key, b"pull")
                except Exception as e:  # no peer access between the GPUs, another host's files, ...
                    log.info("decode engine %d cannot map prefill engine %d's KV pages (%s): they move by "
                             "point-to-point sends", rank, peer, e)
                    store.set(key, b"push")
                    push.append(peer)
                    apart += 1
        store.add(f"kv-apart/{n}", apart)
        store.set(f"kv-met/{n}/{rank}", b"")
        store.wait([f"kv-met/{n}/{r}" for r in world])
        if store.add(f"kv-apart/{n}", 0) == 0:
            # rank 0 hosts the store: it leaves last
            if rank != world[0]:
                store.set(f"kv-left/{n}/{rank}", b"")
            else:
                store.wait([f"kv-left/{n}/{r}" for r in world[1:]])
            leave_group()
        for peer in push:
            t = torch.tensor(mine, device=self.device)
            if rank in prefill_ranks:
                dist.send(t, peer)
            else:
                dist.recv(t, peer)
        if refused is not None:
            raise refused

    def layout(self) -> list[int]:
        kv = self.pool.kv
        return [*kv.shape[:2], *kv.shape[3:], zlib.crc32(self.pool.spec.dtype.encode()),
                int(self.pool.scales is not None)]


def page_words(kv: torch.Tensor, scales: torch.Tensor | None) -> list[torch.Tensor]:
    """A pool's pages [layers, 2, num_blocks, ...] and scales [layers, num_blocks, ...] as words
    [groups, num_blocks, words a block] (kernels/copy_pages.py): a page moves in 8-byte words."""
    out = [_as_words(kv.view(torch.uint8).view(kv.shape[0] * kv.shape[1], kv.shape[2], -1))]
    if scales is not None:
        out.append(_as_words(scales.view(torch.uint8).view(scales.shape[0], scales.shape[1], -1)))
    return out


def _as_words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64) if t.shape[-1] % 8 == 0 else t


def export_pages(pool: KVPool) -> list[tuple[str, Any]]:
    """Picklable handles to a pool's pages and scales, for map_pages() in another process of this
    host: CUDA IPC handles of the allocations (GPU), or this process's memory files (CPU)."""
    out = []
    for t, fd in zip((pool.kv, pool.scales), pool.files):
        if t is None:
            break
        if t.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            out.append(("cuda", reduce_tensor(t)[1]))
        elif fd is not None:
            out.append(("file", (os.getpid(), fd, t.numel() * t.element_size(), t.dtype, tuple(t.shape))))
        else:
            raise RuntimeError("the pool's CPU pages have no memory file to share")
    return out


def map_pages(handles: list[tuple[str, Any]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pages (and scales) behind export_pages()'s handles, mapped into this process: (kv,
    scales or None). On a GPU the tensors read the other GPU's memory over its peer link."""
    tensors = []
    for kind, args in handles:
        if kind == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            if device.type != "cuda":
                raise RuntimeError("GPU pages cannot be mapped by a CPU engine")
            # opened on this engine's own device: mapped there, with peer access to the memory
            # (args[6] is the exporter's device index, which means another GPU here); no wait for
            # the exporter's event of the moment it shared (args[14]): the protocol orders the reads
            index = device.index if device.index is not None else torch.cuda.current_device()
            tensors.append(rebuild_cuda_tensor(*args[:6], index, *args[7:14], False))
        else:
            pid, fd, nbytes, dtype, shape = args
            if device.type != "cpu":
                raise RuntimeError("CPU pages cannot be read by a GPU engine's kernels")
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            try:
                pages = mmap.mmap(f, nbytes)
            finally:
                os.close(f)
            tensors.append(mapped(pages, dtype, shape))
    return tensors[0], (tensors[1] if len(tensors) > 1 else None)


def _nbytes(bufs: list[torch.Tensor]) -> int:
    return sum(b.numel() * b.element_size() for b in bufs)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as flat bytes: gloo and NCCL take any dtype then (fp8 included)."""
    return t.reshape(-1).view(torch.uint8)
