"""The paged KV cache's allocator. Torch-free: it hands out block ids, the pool holds the tensors.

A block is owned by the sequences whose block tables list it; ref_count counts them. Out of blocks
is not an error: allocation answers None and the scheduler decides whom to preempt.

Prefix caching: a full block is named by a hash chained over its prefix (the parent block's hash
and its own token ids). A lookup that finds the hash confirms the block's stored token ids before
reuse. A freed block keeps its hash and stays reusable until memory is needed; the free queue is
ordered least recently freed first, so eviction is LRU. Every operation is O(1) per block.

Host tier (optional, kvcache/host_tier.py): a cached block evicted here is queued to be copied to
host memory; a prompt whose next blocks miss here but hit there gets fresh blocks, registered
under the same hashes, with copies from the host queued (take_moves() hands them to the step).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence as Seq
from itertools import islice

from kvcache.host_tier import HostEntry, HostTier, KVMoves

WRITE_AHEAD_MIN = 32  # blocks the write-ahead may queue per step, at least (more after steps that allocate more)


def lora_root(lora: int) -> int | None:
    """The parent of the first block of a sequence on LoRA adapter `lora` (None: the base model)."""
    return hash((-1, lora)) if lora else None


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The name of a full block: its parent's name and its own token ids. (Inlined where every
    block of every prompt is hashed: _extend_memo, match_prefix.)"""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently freed first (the next to be handed out / evicted).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.num_evictions = 0
        self.host: HostTier | None = None  # attach_host()
        self.moves = KVMoves()  # copies queued for the next step
        self.num_blocks_out = 0  # blocks queued device -> host
        self.num_blocks_in = 0  # blocks queued host -> device
        self._allocated = 0  # blocks allocated since the last take_moves (the write-ahead's pace)

    def attach_host(self, host: HostTier) -> None:
        assert host.block_size == self.block_size and self.enable_caching
        self.host = host

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (and nothing taken) when fewer are free.
        Cached blocks on the free queue are evicted as they are handed out."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            if self.host is not None:
                self._allocated += 1
                if self.block_hashes[b] is not None:
                    self._offload(b)
            self._uncache(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def append(self, block_table: list[int], num_tokens: int) -> list[int] | None:
        """Grow block_table in place so it covers num_tokens tokens. Returns the blocks added
        (possibly none), or None when there are not enough free blocks (the table is unchanged)."""
        if num_tokens <= len(block_table) * self.block_size:
            return []  # the common decode step: room in the last block
        need = self.blocks_needed(num_tokens) - len(block_table)
        new = self.allocate(need)
        if new is not None:
            block_table.extend(new)
        return new

    def share(self, block: int) -> None:
        """Another owner takes a reference to a block (a free cached block leaves the free queue)."""
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def free(self, block_table: Seq[int]) -> None:
        """Drop one reference to each block. Tail blocks are queued first so that, among a
        sequence's cached blocks, the ends of prefixes are evicted before their beginnings."""
        for b in reversed(block_table):
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None

    # -- prefix caching ------------------------------------------------------------------------

    def prefix_hashes(self, token_ids: Seq[int], hashes: list[int], num_blocks: int | None = None,
                      root: int | None = None) -> list[int]:
        """Extend `hashes` (a sequence's memo) to cover every full block of token_ids, or its
        first num_blocks blocks; return it. root: the first block's parent (lora_root: blocks of a
        LoRA adapter's sequence hold other K/V than the base model's)."""
        full = len(token_ids) // self.block_size
        if num_blocks is not None:
            full = min(num_blocks, full)
        if len(hashes) < full:
            self._extend_memo(hashes, list(self._blocks(token_ids, len(hashes), full)), len(hashes), root)
        return hashes

    def _blocks(self, token_ids: Seq[int], first: int, last: int) -> Iterator[tuple[int, ...]]:
        """The token ids of blocks first..last-1, as tuples, made in C (bs at a time). Each serves
        for the block's hash and its confirmation or registration alike: a prompt's tokens are read
        once, not once per purpose."""
        tokens = iter(islice(token_ids, first * self.block_size, last * self.block_size))
        return zip(*[tokens] * self.block_size)

    @staticmethod
    def _extend_memo(hashes: list[int], blocks: list[tuple[int, ...]], first: int, root: int | None = None) -> None:
        """Append the hashes of blocks (the token ids of blocks first, first + 1, ...) that the
        memo lacks; it covers the blocks before first."""
        assert len(hashes) >= first, "the memo must cover the blocks before these"
        parent = hashes[-1] if hashes else root
        for block in blocks[len(hashes) - first:]:
            parent = hash((parent, block))  # block_hash(), inlined: this runs for every block of every prompt
            hashes.append(parent)

    def match_prefix(self, token_ids: Seq[int], hashes: list[int], root: int | None = None) -> list[int]:
        """The cached blocks holding the longest prefix of token_ids (full blocks only). Looks,
        takes nothing: pass the result to admit(). Extends the memo `hashes` up to the first miss,
        in the same pass (cache_blocks() hashes the rest)."""
        if not self.enable_caching:
            return []
        cached, block_tokens = self.cached, self.block_tokens
        known = len(hashes)
        parent = root
        hits = []
        for i, block in enumerate(self._blocks(token_ids, 0, len(token_ids) // self.block_size)):
            if i < known:
                parent = hashes[i]
            else:
                parent = hash((parent, block))  # block_hash(), inlined
                hashes.append(parent)
            b = cached.get(parent)
            if b is None or block_tokens[b] != block:
                break
            hits.append(b)
        return hits

    def admit(self, hits: list[int], num_tokens: int, host_hits: list[HostEntry] | None = None) -> list[int] | None:
        """A block table for a new sequence: the prefix-cache hits, then the host tier's hits (fresh
        blocks, copies from the host queued), then fresh blocks up to num_tokens tokens. None
        (nothing taken) if the free blocks don't suffice."""
        if host_hits:
            return self._admit_with_host(hits, num_tokens, host_hits)
        ref_counts, free_queue = self.ref_counts, self.free_queue
        new = self.blocks_needed(num_tokens) - len(hits)
        idle_hits = [ref_counts[b] for b in hits].count(0)  # cached blocks that are free now
        if new + idle_hits > len(free_queue):
            return None
        for b in hits:  # share(b), inlined: this runs for every block of every admitted prefix
            if ref_counts[b] == 0:
                del free_queue[b]
            ref_counts[b] += 1
        table = list(hits)
        table.extend(self.allocate(max(0, new)) or [])
        return table

    # -- host tier -------------------------------------------------------------------------------

    def _offload(self, b: int) -> None:
        """b, a cached block about to be reused, goes to the host tier (unless already there)."""
        assert self.host is not None
        tokens = self.block_tokens[b]
        assert tokens is not None
        slot = self.host.store(self.block_hashes[b], tokens)
        if slot is not None:
            self.moves.outs.append((b, slot))
            self.num_blocks_out += 1

    def match_host(self, token_ids: Seq[int], hashes: list[int], first: int, root: int | None = None) -> list[HostEntry]:
        """The host-tier entries of the blocks after the first `first` (the device hits), up to the
        first miss. Extends the memo `hashes` as it goes."""
        host = self.host
        if host is None:
            return []
        full = len(token_ids) // self.block_size
        if first >= full:
            return []
        self.prefix_hashes(token_ids, hashes, first, root)
        found = []
        for i, block in enumerate(self._blocks(token_ids, first, full), first):
            if i >= len(hashes):
                self._extend_memo(hashes, [block], i, root)
            e = host.lookup(hashes[i], block)
            if e is None:
                break
            found.append(e)
        return found

    def take_moves(self) -> KVMoves | None:
        """The copies queued since the last call, for the step about to launch (None: none), with
        the write-ahead of the blocks next in line for eviction (kvcache/host_tier.py)."""
        if self.host is None:
            return None
        self._write_ahead(max(WRITE_AHEAD_MIN, self._allocated))
        self._allocated = 0
        if not self.moves:
            return None
        moves, self.moves = self.moves, KVMoves()
        self.host.unpin_all()  # their copy-ins are ordered before any later copy-out
        return moves

    def _write_ahead(self, limit: int) -> None:
        """Queue host copies of up to `limit` cached free blocks from the eviction end of the free
        queue that the host tier lacks; they stay cached here (scanning at most 4x limit blocks)."""
        host, hashes, tokens, ahead = self.host, self.block_hashes, self.block_tokens, self.moves.ahead
        assert host is not None
        queued = 0
        for b in islice(self.free_queue, 4 * limit):
            h = hashes[b]
            if h is None or host.holds(h):
                continue
            slot = host.store(h, tokens[b])
            if slot is None:
                break
            ahead.append((b, slot))
            self.num_blocks_out += 1
            queued += 1
            if queued >= limit:
                break

    def moves_failed(self, moves: KVMoves) -> None:
        """The step that carried these copies failed before or while doing them: forget what they
        would have filled (the host entries of the copy-outs, the device blocks of the copy-ins)."""
        if self.host is not None:
            self.host.discard_slots([slot for _, slot in moves.outs + moves.ahead])
        for _, b in moves.ins:
            self._uncache(b)

    def _admit_with_host(self, hits: list[int], num_tokens: int, host_hits: list[HostEntry]) -> list[int] | None:
        assert self.host is not None
        new = self.blocks_needed(num_tokens) - len(hits) - len(host_hits)
        idle_hits = [self.ref_counts[b] for b in hits].count(0)
        if len(host_hits) + max(0, new) + idle_hits > len(self.free_queue):
            return None
        for b in hits:
            self.share(b)
        for e in host_hits:
            self.host.pin(e.slot)  # the evictions below must not reuse these slots
        loaded = self.allocate(len(host_hits))
        assert loaded is not None
        for b, e in zip(loaded, host_hits):
            self.moves.ins.append((e.slot, b))
            self.num_blocks_in += 1
            if e.block_hash not in self.cached:
                self.cached[e.block_hash] = b
                self.block_hashes[b] = e.block_hash
                self.block_tokens[b] = e.tokens
        table = list(hits) + loaded
        table.extend(self.allocate(max(0, new)) or [])
        return table

    def cache_blocks(self, block_table: Seq[int], token_ids: Seq[int], hashes: list[int], start: int, end: int,
                     root: int | None = None) -> None:
        """Register the blocks that become full while tokens [start, end) are computed. The
        scheduler calls this when it schedules them, so a sequence admitted later in the same
        step can share them: every layer writes the step's K/V into the pages before any attention
        reads them. If the step fails, uncache() must take them back."""
        if not self.enable_caching:
            return
        bs = self.block_size
        first, last = start // bs, min(end // bs, len(block_table))
        if first >= last:
            return  # no block becomes full in this range (most decode steps)
        self.prefix_hashes(token_ids, hashes, first, root)  # the chain before this range
        blocks = list(self._blocks(token_ids, first, last))
        self._extend_memo(hashes, blocks, first, root)
        cached, block_hashes = self.cached, self.block_hashes
        for i, block in enumerate(blocks, first):
            b, h = block_table[i], hashes[i]
            if block_hashes[b] is not None:
                continue
            if h in cached:
                continue  # the same prefix already lives in another block; keep that one
            cached[h] = b
            block_hashes[b] = h
            self.block_tokens[b] = block

    def uncache(self, block_table: Seq[int], start: int, end: int) -> None:
        """Forget the blocks cache_blocks(block_table, ..., start, end) registered: their K/V
        were never written (the step failed)."""
        bs = self.block_size
        for i in range(start // bs, min(end // bs, len(block_table))):
            h = self.block_hashes[block_table[i]]
            if h is not None and self.host is not None:
                self.host.discard_hash(h)  # a copy of it, queued before the failure, holds nothing valid
            self._uncache(block_table[i])

    def _uncache(self, b: int) -> None:
        h = self.block_hashes[b]
        if h is not None:
            del self.cached[h]
            self.block_hashes[b] = None
            self.block_tokens[b] = None
            self.num_evictions += 1

    def check_integrity(self, block_tables: Iterable[Seq[int]]) -> None:
        """Raise AssertionError unless every block is free XOR owned, ref counts equal the number
        of owning tables, and the prefix cache maps each hash to a block that carries it."""
        owners = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                owners[b] += 1
        for b in range(self.num_blocks):
            assert owners[b] == self.ref_counts[b], f"block {b}: ref count {self.ref_counts[b]} but {owners[b]} owners"
            assert (b in self.free_queue) == (owners[b] == 0), f"block {b}: free={b in self.free_queue} with {owners[b]} owners"
        for h, b in self.cached.items():
            assert self.block_hashes[b] == h, f"cache entry {h} -> block {b} whose hash is {self.block_hashes[b]}"
            assert self.block_tokens[b] is not None and len(self.block_tokens[b]) == self.block_size
        assert sum(h is not None for h in self.block_hashes) == len(self.cached), "a hashed block is not in the cache"
