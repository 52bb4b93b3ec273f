"""Property tests of the block manager: after any sequence of operations, no block is lost or
double-owned, and the prefix cache stays consistent."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache.block_manager import BlockManager


def test_allocate_returns_none_and_takes_nothing_when_short():
    bm = BlockManager(4, 16)
    assert bm.allocate(5) is None
    assert bm.num_free_blocks == 4
    table = []
    assert bm.append(table, 40) == table and len(table) == 3
    assert bm.append(table, 80) is None and len(table) == 3
    bm.free(table)
    bm.check_integrity([])


def test_prefix_hit_confirms_tokens_and_lru_eviction():
    bm = BlockManager(4, 2, enable_caching=True)
    toks = [1, 2, 3, 4, 5]
    hashes: list[int] = []
    table = bm.admit([], 5)
    bm.cache_blocks(table, toks, hashes, 0, 5)
    assert len(bm.cached) == 2  # two full blocks; the partial third is never cached
    bm.free(table)
    assert bm.match_prefix([1, 2, 3, 4, 9], []) == table[:2]
    assert bm.match_prefix([1, 2, 7, 4], []) == table[:1]
    assert bm.match_prefix([9, 2, 3, 4], []) == []
    # A forged hash collision must not be trusted: the stored tokens are compared.
    h = bm.prefix_hashes([7, 7], [])[0]
    bm.cached[h] = table[0]
    bm.block_hashes[table[0]], saved = h, bm.block_hashes[table[0]]
    assert bm.match_prefix([7, 7], []) == []
    bm.block_hashes[table[0]] = saved
    del bm.cached[h]
    bm.check_integrity([])


def test_uncache_takes_back_what_a_failed_step_registered():
    bm = BlockManager(8, 2, enable_caching=True)
    toks = [1, 2, 3, 4, 5, 6, 7]
    hashes: list[int] = []
    table = bm.admit([], 7)
    bm.cache_blocks(table, toks, hashes, 0, 4)  # an earlier, successful step
    bm.cache_blocks(table, toks, hashes, 4, 7)  # this step: block 2 becomes full
    assert len(bm.cached) == 3
    bm.uncache(table, 4, 7)
    assert len(bm.cached) == 2 and bm.match_prefix(toks, []) == table[:2]
    bm.free(table)
    # Allocation evicts least recently freed first: the third (uncached) block, then the prefix tail.
    got = bm.allocate(3)
    assert got is not None
    bm.free(got)
    bm.check_integrity([])


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences own block tables; they allocate, grow, share prefixes, get preempted and freed."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.seqs: dict[int, dict] = {}
        self.next_id = 0

    @rule(n=st.integers(1, 12), vocab=st.integers(1, 3), data=st.data())
    def add(self, n, vocab, data):
        toks = data.draw(st.lists(st.integers(0, vocab), min_size=n, max_size=n))
        hashes: list[int] = []
        hits = self.bm.match_prefix(toks, hashes)
        if len(hits) * self.bm.block_size >= len(toks):
            hits.pop()
        table = self.bm.admit(hits, len(toks))
        if table is not None:
            self.seqs[self.next_id] = dict(table=table, toks=toks, hashes=hashes, computed=len(hits) * self.bm.block_size)
            self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute_and_grow(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        self.bm.cache_blocks(s["table"], s["toks"], s["hashes"], s["computed"], len(s["toks"]))
        s["computed"] = len(s["toks"])
        s["toks"].append(data.draw(st.integers(0, 3)))
        if self.bm.append(s["table"], len(s["toks"])) is None:
            # out of blocks: preempt this sequence (free everything; it would recompute later)
            self.bm.free(s["table"])
            del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(self.seqs.pop(sid)["table"])

    @invariant()
    def integrity(self):
        if hasattr(self, "bm"):
            self.bm.check_integrity([s["table"] for s in self.seqs.values()])
            for s in self.seqs.values():  # shared blocks still hold this sequence's tokens
                bs = self.bm.block_size
                for i, b in enumerate(s["table"]):
                    if self.bm.block_tokens[b] is not None:
                        assert self.bm.block_tokens[b] == tuple(s["toks"][i * bs:(i + 1) * bs])


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(0, 2**32))
@settings(max_examples=60, deadline=None)
def test_random_alloc_free_never_loses_blocks(sizes, seed):
    rng = random.Random(seed)
    bm = BlockManager(32, 4)
    tables = []
    for n in sizes:
        t = bm.admit([], n)
        if t is not None:
            tables.append(t)
        if tables and rng.random() < 0.4:
            bm.free(tables.pop(rng.randrange(len(tables))))
        bm.check_integrity(tables)
    for t in tables:
        bm.free(t)
    assert bm.num_free_blocks == 32
