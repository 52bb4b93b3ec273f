"""The host tier of the prefix cache: which host slots hold which blocks, least recently used first.

Torch-free bookkeeping, like the block manager: the tensors live in kvcache/host_pool.py. A block
evicted from the device cache is stored here under the same chained hash (kvcache/block_manager.py);
a later prompt whose next block misses on the device but hits here gets it copied back instead of
recomputed. Each entry remembers its hash, its token ids and the layout of the cache that wrote it
(block size, dtype, shard); a lookup whose hash matches but whose tokens or layout differ is a miss
(counted in num_integrity_misses) and the entry is dropped.

Moves: the block manager queues copies (device block -> host slot on eviction, host slot -> device
block on a hit) in a KVMoves, which rides on the next Batch to the runner. The runner does the
copy-outs before the copy-ins, on one ordered stream, before the step's forward reads the blocks.
A slot a queued copy-in reads from is pinned until the moves are taken, so that no copy-out of the
same batch can overwrite it first.

Write-ahead: the step that reuses an evicted block must wait for its copy-out. So after each
schedule the block manager also queues copies of the cached free blocks next in line for eviction
(`ahead`), which stay cached on the device meanwhile; the step does not wait for those, and when
such a block is evicted later its host copy is already there and nothing is copied then.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


GIB = 1 << 30


def host_tier_blocks(gib: float, bytes_per_block: int) -> int:
    """Blocks (scales included) that gib GiB of host memory hold: the engine's and kv-calc's figure."""
    return int(gib * GIB) // bytes_per_block


@dataclass(frozen=True)
class HostEntry:
    slot: int
    block_hash: int
    tokens: tuple[int, ...]
    layout: str  # HostTier.layout of the cache that wrote it


@dataclass
class KVMoves:
    """Copies queued by one or more schedules, done by the runner before the step's forward: first
    every copy-out (device block -> host slot), then every copy-in (host slot -> device block)."""

    outs: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    ins: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    ahead: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot): write-ahead

    def __bool__(self) -> bool:
        return bool(self.outs or self.ins or self.ahead)


class HostTier:
    def __init__(self, num_slots: int, block_size: int, layout: str, block_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError("the host tier needs at least one block")
        self.num_slots = num_slots
        self.block_size = block_size
        self.layout = layout
        self.block_bytes = block_bytes  # device and host bytes of one block, scales included
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, least recently used first
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.pinned: dict[int, int] = {}  # slot -> pins (queued copy-ins reading it)
        self._released: list[int] = []  # pinned slots whose entry went: free once unpinned
        self.num_stores = 0
        self.num_evictions = 0
        self.num_integrity_misses = 0

    @property
    def num_used(self) -> int:
        return len(self.entries)

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> HostEntry | None:
        """The entry holding this block, now the most recently used; None on a miss (an entry whose
        tokens or layout disagree is dropped and counted)."""
        e = self.entries.get(block_hash)
        if e is None:
            return None
        if e.tokens != tokens or e.layout != self.layout or e.block_hash != block_hash:
            self.num_integrity_misses += 1
            self._drop(e)
            return None
        self.entries.move_to_end(block_hash)
        return e

    def store(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """A slot to copy this block into, or None when nothing needs copying (already here: it only
        becomes the most recently used) or no slot can be freed (all pinned)."""
        e = self.entries.get(block_hash)
        if e is not None and e.tokens == tokens:
            self.entries.move_to_end(block_hash)
            return None
        if e is not None:
            self.num_integrity_misses += 1
            self._drop(e)
        if not self.free_slots and not self._evict_one():
            return None
        slot = self.free_slots.pop()
        self.entries[block_hash] = HostEntry(slot, block_hash, tokens, self.layout)
        self.num_stores += 1
        return slot

    def _evict_one(self) -> bool:
        for e in self.entries.values():  # least recently used first
            if e.slot not in self.pinned:
                self._drop(e)
                self.num_evictions += 1
                return True
        return False

    def _drop(self, e: HostEntry) -> None:
        del self.entries[e.block_hash]
        (self._released if e.slot in self.pinned else self.free_slots).append(e.slot)

    def holds(self, block_hash: int) -> bool:
        """Whether an entry has this hash (no integrity check, no LRU update)."""
        return block_hash in self.entries

    def discard_hash(self, block_hash: int) -> None:
        e = self.entries.get(block_hash)
        if e is not None:
            self._drop(e)

    def discard_slots(self, slots: list[int]) -> None:
        """Forget the entries in these slots (their copy-out may never have run)."""
        gone = set(slots)
        for e in [e for e in self.entries.values() if e.slot in gone]:
            self._drop(e)

    def pin(self, slot: int) -> None:
        self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def unpin_all(self) -> None:
        self.pinned.clear()
        self.free_slots.extend(self._released)
        self._released.clear()

    def check_integrity(self) -> None:
        slots = [e.slot for e in self.entries.values()]
        assert len(set(slots)) == len(slots), "two host entries share a slot"
        assert not set(slots) & set(self.free_slots), "a host slot is both used and free"
        assert len(slots) + len(self.free_slots) + len(self._released) == self.num_slots, "a host slot leaked"
        for h, e in self.entries.items():
            assert e.block_hash == h and len(e.tokens) == self.block_size
