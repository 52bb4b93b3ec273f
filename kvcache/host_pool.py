"""The host tier's tensors and the copies between them and the device pool (kvcache/host_tier.py
keeps the bookkeeping).

Host layout: one slot is one block, all layers, contiguous: kv [slots, layers, 2, kv_heads,
block_size, head_dim] in the pool's storage dtype (fp8/int8 V pages keep their transposed layout:
the bytes move as they are), and for quantized caches scales [slots, layers, kv_heads, 2,
block_size] float32. A block's bytes then cross PCIe as one run (a device-side gather makes the
pool's per-layer pages contiguous first). An anonymous map: beside a CPU pool it costs RAM only
as slots fill; beside a GPU pool it is page-locked, all of it, at start-up.

Ordering (KVCopier.apply): on a GPU the copies run on a side stream that first waits for
everything queued on the compute stream so far (the steps that wrote the blocks being evicted, and
any still reading blocks about to be refilled); the compute stream then waits for the copies'
event before the step's forward, which reads the refilled blocks. The host never waits. Copy-outs
go before copy-ins: a copy-in may read a slot that a copy-out of the same batch just filled, or
refill a block whose old contents a copy-out of the same batch saves. The write-ahead copies
(kvcache/host_tier.py) go last, after that event: the step runs beside them, and the next step
waits for them (before_step), since it may reuse those blocks. On the CPU the same copies run in
the same order, synchronously.
"""
from __future__ import annotations

import weakref

import torch

from kvcache.host_tier import KVMoves
from kvcache.pool import KVPool, zeros

CHUNK_BYTES = 64 << 20  # device scratch per gather/scatter: bounds the extra GPU memory a batch of moves uses


def layout_key(pool: KVPool) -> str:
    """What a host entry must agree with to be read back into this pool (kvcache/host_tier.py)."""
    s = pool.spec
    return f"{s.dtype}/bs{s.block_size}/L{s.num_layers}/H{s.num_kv_heads}/D{s.head_dim}"


class HostKVPool:
    def __init__(self, pool: KVPool, num_slots: int, pin: bool) -> None:
        spec = pool.spec
        self.num_slots = num_slots
        kv_shape = (num_slots, spec.num_layers, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)
        scale_shape = (num_slots, spec.num_layers, spec.num_kv_heads, 2, spec.block_size)
        self.kv = zeros(kv_shape, pool.kv.dtype, "cpu")
        self.scales = zeros(scale_shape, torch.float32, "cpu") if pool.scales is not None else None
        if pin:
            for t in (self.kv, self.scales):
                if t is not None:
                    pin_in_place(t)

    @property
    def nbytes(self) -> int:
        n = self.kv.numel() * self.kv.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)


def pin_in_place(t: torch.Tensor) -> None:
    """Page-lock t's memory (cudaHostRegister), so that copies to and from the GPU run asynchronously
    at full speed. Not pin_memory(): torch's pinned allocator rounds each allocation up to a power of
    two, which for tens of GiB could ask for nearly twice the RAM."""
    nbytes = t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    result = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    err = int(getattr(result, "value", result))
    if err != 0:
        raise ValueError(f"could not pin {nbytes / (1 << 30):.1f} GiB of host memory for the KV host tier "
                         f"(CUDA error {err}); lower --kv-offload-gib")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(position in slots, first slot, length) of each run of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            p, first, n = out[-1]
            out[-1] = (p, first, n + 1)
        else:
            out.append((i, s, 1))
    return out


class KVCopier:
    """Does a step's KVMoves between a device pool and its host pool (the module's docstring)."""

    def __init__(self, pool: KVPool, host: HostKVPool) -> None:
        self.pool = pool
        self.host = host
        self.device = pool.kv.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        per_block = pool.spec.bytes_per_block
        self.chunk = max(1, CHUNK_BYTES // per_block)
        # (device tensor, its block dimension, host tensor): pages as bytes, so that every storage
        # dtype (fp8 included) takes the same byte gathers and scatters
        self.pairs = [(pool.kv.view(torch.uint8), 2, host.kv.view(torch.uint8))]
        if pool.scales is not None:
            assert host.scales is not None
            self.pairs.append((pool.scales, 1, host.scales))
        self.bytes_out = 0
        self.bytes_in = 0
        self._ahead_done: torch.cuda.Event | None = None  # the last write-ahead, not yet waited for

    def before_step(self, moves: KVMoves | None) -> None:
        """Called at every step's launch, before its forward (moves: the step's, or None)."""
        if moves is not None:
            self.apply(moves.outs, moves.ins, moves.ahead)
        elif self._ahead_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ahead_done)
            self._ahead_done = None

    @torch.inference_mode()
    def apply(self, outs: list[tuple[int, int]], ins: list[tuple[int, int]],
              ahead: list[tuple[int, int]] | None = None) -> None:
        """A step's moves, queued before its forward: outs (blocks it reuses), then ins (blocks it
        reads), which the forward waits for; then the write-ahead of blocks no step uses now, which
        the next step's forward waits for (it may reuse them)."""
        if self.stream is None:
            self._copy(outs, ins)
            self._copy(ahead or [], [])
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            self._copy(outs, ins)
            done = torch.cuda.Event()
            done.record(self.stream)  # after the previous step's write-ahead too: one ordered stream
            self._copy(ahead or [], [])
            self._ahead_done = None
            if ahead:
                self._ahead_done = torch.cuda.Event()
                self._ahead_done.record(self.stream)
        main.wait_event(done)  # the step's forward reads the refilled blocks after this

    def _copy(self, outs: list[tuple[int, int]], ins: list[tuple[int, int]]) -> None:
        for i in range(0, len(outs), self.chunk):
            part = outs[i:i + self.chunk]
            self._out([b for b, _ in part], [s for _, s in part])
        for i in range(0, len(ins), self.chunk):
            part = ins[i:i + self.chunk]
            self._in([s for s, _ in part], [b for _, b in part])

    def _index(self, blocks: list[int]) -> torch.Tensor:
        idx = torch.tensor(blocks, dtype=torch.int64)
        if not self.cuda:
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def _out(self, blocks: list[int], slots: list[int]) -> None:
        """Device blocks -> host slots: gather (pages of every layer made contiguous per block), copy."""
        idx = self._index(blocks)
        for src, dim, dst in self.pairs:
            gathered = src.index_select(dim, idx).movedim(dim, 0).contiguous()
            for p, first, n in _runs(slots):
                dst[first:first + n].copy_(gathered[p:p + n], non_blocking=self.cuda)
            self.bytes_out += gathered.numel() * gathered.element_size()

    def _in(self, slots: list[int], blocks: list[int]) -> None:
        """Host slots -> device blocks: copy into scratch, scatter into the pool's pages."""
        idx = self._index(blocks)
        for dst, dim, src in self.pairs:
            scratch = torch.empty((len(slots), *src.shape[1:]), dtype=src.dtype, device=self.device)
            for p, first, n in _runs(slots):
                scratch[p:p + n].copy_(src[first:first + n], non_blocking=self.cuda)
            dst.index_copy_(dim, idx, scratch.movedim(0, dim))
            self.bytes_in += scratch.numel() * scratch.element_size()
