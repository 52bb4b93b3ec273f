"""The host tier's bookkeeping (torch-free): LRU, integrity, pins, and the block manager's moves."""
from __future__ import annotations

from kvcache.block_manager import BlockManager
from kvcache.host_tier import HostTier, host_tier_blocks

BS = 4


def toks(i: int) -> tuple[int, ...]:
    return tuple(range(i * BS, (i + 1) * BS))


def test_lru_eviction_and_touch():
    host = HostTier(3, BS, "L", 100)
    slots = [host.store(h, toks(h)) for h in (1, 2, 3)]
    assert sorted(slots) == [0, 1, 2] and host.num_used == 3
    assert host.lookup(1, toks(1)) is not None  # 1 is now the most recently used: 2 goes next
    s4 = host.store(4, toks(4))
    assert s4 == slots[1] and host.lookup(2, toks(2)) is None
    assert host.store(3, toks(3)) is None  # already there: nothing to copy, only touched
    assert host.num_evictions == 1
    host.check_integrity()


def test_integrity_mismatch_is_a_miss():
    host = HostTier(2, BS, "fp16/bs4", 100)
    host.store(7, toks(7))
    assert host.lookup(7, toks(8)) is None  # same hash, other tokens
    assert host.num_integrity_misses == 1 and host.num_used == 0
    host.store(9, toks(9))
    host.layout = "fp8/bs4"  # a cache of another layout reads it: a miss, and the entry goes
    assert host.lookup(9, toks(9)) is None and host.num_integrity_misses == 2
    host.check_integrity()


def test_pinned_slots_are_not_evicted():
    host = HostTier(2, BS, "L", 100)
    a, b = host.store(1, toks(1)), host.store(2, toks(2))
    host.pin(a)
    assert host.store(3, toks(3)) == b  # 1 is older but pinned
    host.pin(b)
    assert host.store(4, toks(4)) is None  # everything pinned: not stored
    host.unpin_all()
    assert host.store(4, toks(4)) is not None
    host.check_integrity()


def manager(num_blocks: int = 4, host_slots: int = 8) -> BlockManager:
    bm = BlockManager(num_blocks, BS, enable_caching=True)
    bm.attach_host(HostTier(host_slots, BS, "L", 100))
    return bm


def cached_and_freed(bm: BlockManager, prompt: list[int]) -> list[int]:
    """The prompt's blocks admitted on an empty cache, cached and freed: its table."""
    hashes: list[int] = []
    table = bm.admit([], len(prompt))
    bm.cache_blocks(table, prompt, hashes, 0, len(prompt))
    bm.free(table)
    return table


def test_evicted_blocks_go_down_and_come_back():
    bm = manager()
    prompt = list(range(3 * BS + 1))
    hashes: list[int] = []
    table = bm.admit(bm.match_prefix(prompt, hashes), len(prompt))
    bm.cache_blocks(table, prompt, hashes, 0, len(prompt))
    bm.free(table)
    other = bm.allocate(4)  # evicts the prompt's three cached blocks: three copies to the host
    moves = bm.take_moves()
    assert sorted(b for b, _ in moves.outs) == sorted(table[:3]) and not moves.ins and not moves.ahead
    assert bm.num_blocks_out == 3 and bm.host.num_used == 3
    bm.free(other)
    again: list[int] = []
    hits = bm.match_prefix(prompt, again)
    assert hits == []
    found = bm.match_host(prompt, again, 0)
    assert [e.tokens for e in found] == [toks(0), toks(1), toks(2)]
    table2 = bm.admit(hits, len(prompt), found)
    moves = bm.take_moves()
    assert [s for s, _ in moves.ins] == [e.slot for e in found] and [b for _, b in moves.ins] == table2[:3]
    assert bm.num_blocks_in == 3
    # the reloaded blocks are in the device cache again, under the same hashes
    assert bm.match_prefix(prompt, []) == table2[:3]
    bm.free(table2)
    bm.check_integrity([])
    bm.host.check_integrity()


def test_failed_step_forgets_its_moves():
    bm = manager()
    prompt = list(range(2 * BS))
    cached_and_freed(bm, prompt)
    bm.allocate(4)
    moves = bm.take_moves()
    bm.moves_failed(moves)  # the copies may never have run: the host entries must not be trusted
    assert bm.host.num_used == 0 and bm.match_host(prompt, [], 0) == []
    bm.host.check_integrity()


def test_capacity_arithmetic():
    assert host_tier_blocks(1.0, 1 << 20) == 1024
    assert host_tier_blocks(0.0, 100) == 0


def test_write_ahead_copies_the_next_evictions_early():
    bm = manager()
    prompt = list(range(3 * BS + 1))
    table = cached_and_freed(bm, prompt)
    moves = bm.take_moves()  # the three cached free blocks, in eviction order, still cached here
    assert not moves.outs and not moves.ins
    assert [b for b, _ in moves.ahead] == [table[2], table[1], table[0]]
    assert bm.match_prefix(prompt, []) == table[:3]
    assert bm.take_moves() is None  # nothing new to copy
    bm.allocate(4)  # evicting them now copies nothing: the host has them
    assert bm.take_moves() is None
    assert [e.tokens for e in bm.match_host(prompt, [], 0)] == [toks(0), toks(1), toks(2)]
    bm.host.check_integrity()


def test_failed_step_drops_host_copies_of_its_blocks():
    bm = manager()
    prompt = list(range(2 * BS))
    table = cached_and_freed(bm, prompt)
    bm.take_moves()  # written ahead to the host
    assert bm.host.num_used == 2
    bm.share(table[0])
    bm.share(table[1])
    bm.uncache(table, 0, len(prompt))  # the step that wrote them failed
    assert bm.host.num_used == 0
