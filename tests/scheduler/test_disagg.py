"""Prefill/decode disaggregation's cores (scheduler/disagg.py) with a fake executor whose sampled
token depends on every KV slot it reads, and a fake transport that moves pages between two fake
pools, sent (push) or copied by the decode side from blocks the prefill side lends (pull): a prompt
prefilled on one core and decoded on another gives one core's tokens and text; a full decode pool
makes arrivals wait (never a crash); aborts free blocks on both sides; lent blocks stay taken until
released; a first token that ends the request keeps nothing."""
from __future__ import annotations

import dataclasses
from array import array

import pytest

from scheduler.core import EngineCore
from scheduler.disagg import HANDOFF, DecodeCore, PrefillCore
from scheduler.policy import SchedulerConfig
from scheduler.request import KVTransferParams, PromptChunk, SampleOutput, SamplingParams
from serve.build import TokenIdTokenizer

BS = 4
EOS = 7


class FakePool:
    def __init__(self, num_blocks: int) -> None:
        self.pages = [[None] * BS for _ in range(num_blocks)]


def fake_prompt_logprobs(it) -> PromptChunk | None:
    """A chunk's prompt logprobs as the runner hands them over, each prompt token's logprob minus its
    id (rank 1, no top tokens), for the scored positions engine/prompt_logprobs.py takes."""
    seq = it.seq
    if not seq.wants_prompt_logprobs:
        return None
    stop = min(it.end, seq.num_prompt_tokens - 1)
    if stop <= it.start:
        return None
    scored = seq.token_ids[it.start + 1:stop + 1]
    return PromptChunk(array("f", [-float(t) for t in scored]), array("q", [1] * len(scored)), array("q"), array("f"))


class FakeExecutor:
    """Writes each scheduled token into its KV slot; a sampled token is a hash of every slot the
    position attends to, so KV that moved wrong changes the output."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool

    def execute(self, batch):
        out = []
        for it in batch.items:  # a step writes every item's K/V before any attention reads
            seq, table = it.seq, it.seq.block_table
            for pos in range(it.start, it.end):
                self.pool.pages[table[pos // BS]][pos % BS] = seq.token_ids[pos]
        for it in batch.items:
            seq, table = it.seq, it.seq.block_table
            prompt = fake_prompt_logprobs(it)
            if not it.samples:
                out.append(None if prompt is None else SampleOutput(-1, prompt=prompt))
                continue
            seen = [self.pool.pages[table[p // BS]][p % BS] for p in range(it.end)]
            assert None not in seen, f"seq {seq.seq_id} reads an unwritten slot"
            h = sum((i + 1) * t for i, t in enumerate(seen))
            out.append(SampleOutput(20 + h % 500, prompt=prompt))
        return out


class FakeTransport:
    """Pages through a mailbox keyed by (sender, receiver, tag), as point-to-point sends would; or,
    given `pools` (every engine's pool by rank), copied by the receiver from the sender's lent
    blocks. A copy lands at the second copied() asked of it, as a GPU's would after a step."""

    def __init__(self, pool: FakePool, rank: int, mailbox: dict, pools: dict | None = None) -> None:
        self.pool, self.rank, self.mailbox, self.pools = pool, rank, mailbox, pools
        self.timed: list[tuple[int, float]] = []
        self.landing: set[int] = set()
        if pools is not None:
            pools[rank] = pool

    def lends_to(self, peer):
        return self.pools is not None

    def pull(self, blocks, peer, src_blocks, tag):
        src = self.pools[peer]
        for b, s in zip(blocks, src_blocks):
            assert None not in src.pages[s] or s == src_blocks[-1], "a lent block was overwritten or never written"
            self.pool.pages[b] = list(src.pages[s])
        self.landing.add(tag)
        self.timed.append((len(blocks) * BS * 8, 0.001))
        return len(blocks) * BS * 8

    def copied(self, tag):
        if tag in self.landing:
            self.landing.discard(tag)
            return False
        return True

    def send(self, blocks, peer, tag):
        self.mailbox[(self.rank, peer, tag)] = [list(self.pool.pages[b]) for b in blocks]
        return len(blocks) * BS * 8

    def recv(self, blocks, peer, tag):
        pages = self.mailbox.pop((peer, self.rank, tag))
        assert len(pages) == len(blocks)
        for b, page in zip(blocks, pages):
            self.pool.pages[b] = list(page)
        self.timed.append((len(blocks) * BS * 8, 0.001))
        return len(blocks) * BS * 8

    def discard(self, num_blocks, peer, tag):
        assert len(self.mailbox.pop((peer, self.rank, tag))) == num_blocks
        self.timed.append((num_blocks * BS * 8, 0.001))
        return num_blocks * BS * 8

    def timings(self):
        timed, self.timed = self.timed, []
        return timed


def make(cls, num_blocks=32, caching=True, max_num_seqs=8):
    pool = FakePool(num_blocks)
    core = cls(FakeExecutor(pool), TokenIdTokenizer(600), SchedulerConfig(max_num_seqs, 64, 256, caching),
               num_blocks, BS, frozenset({EOS}))
    return core, pool


def params(max_tokens=8, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [30, 31, 32], [40, 41, 42, 43], [11, 12, 13, 14, 15, 16, 17, 18, 50]]


def run_one(prompts, p):
    core, _ = make(EngineCore)
    seqs = [core.add_request(ids, p) for ids in prompts]
    toks = {s.seq_id: [] for s in seqs}
    text = {s.seq_id: "" for s in seqs}
    while core.has_unfinished():
        for out in core.step():
            toks[out.seq_id] += out.new_token_ids
            text[out.seq_id] += out.new_text
    return [toks[s.seq_id] for s in seqs], [text[s.seq_id] for s in seqs]


class Pair:
    """A prefill core and a decode core, and the server's part between them."""

    def __init__(self, way="push", decode_blocks=32, max_num_seqs=8):
        self.mailbox: dict = {}
        self.pools = {} if way == "pull" else None
        self.p, pool_p = make(PrefillCore)
        self.d, pool_d = make(DecodeCore, decode_blocks, caching=False, max_num_seqs=max_num_seqs)
        self.p.transport = FakeTransport(pool_p, 0, self.mailbox, self.pools)
        self.d.transport = FakeTransport(pool_d, 1, self.mailbox, self.pools)
        self.tag = 0
        self.origin: dict[int, int] = {}  # decode seq id -> prefill seq id
        self.max_blocked = 0  # the most arrivals waiting for decode blocks at once

    def add(self, ids, p):
        hand_off = KVTransferParams(hand_off=True)
        return self.p.add_request(ids, dataclasses.replace(p, max_tokens=1, kv_transfer=hand_off))

    def run(self, prompts, p, on_ready=None):
        seqs = [self.add(ids, p) for ids in prompts]
        by_id = {s.seq_id: i for i, s in enumerate(seqs)}
        toks = [[] for _ in seqs]
        text = [""] * len(seqs)
        reasons = [None] * len(seqs)
        for _ in range(500):
            if not (self.p.has_unfinished() or self.d.has_unfinished()):
                break
            for out in self.p.step():
                i = by_id[out.seq_id]
                toks[i] += out.new_token_ids
                text[i] += out.new_text
                if out.finish_reason == HANDOFF:
                    dsid = 1000 + out.seq_id
                    self.origin[dsid] = out.seq_id
                    remote = KVTransferParams(remote_tokens=len(prompts[i]))
                    self.d.add_request(prompts[i] + out.new_token_ids, dataclasses.replace(p, kv_transfer=remote),
                                       seq_id=dsid)
                else:
                    reasons[i] = out.finish_reason
            ready = []
            for out in self.d.step():
                i = by_id[self.origin[out.seq_id]]
                if not out.new_token_ids and not out.finished:
                    ready.append(out.seq_id)
                    continue
                toks[i] += out.new_token_ids
                text[i] += out.new_text
                if out.finished:
                    reasons[i] = out.finish_reason
            self.max_blocked = max(self.max_blocked, sum(not s.block_table for s in self.d.arriving.values()))
            for dsid in ready:
                if on_ready is not None:
                    on_ready(self, dsid)
                self.transfer(dsid)
            self.check()
        return toks, text, reasons

    def transfer(self, dsid):
        self.tag += 1
        try:
            sent = self.p.send_kv(self.origin[dsid], 1, self.tag)
        except KeyError:
            self.d.abort(dsid)
            return
        got = self.d.receive_kv(dsid, 0, self.tag, sent.num_blocks, sent.lent)
        if sent.lent is None:
            return
        assert got.landing and self.p.lent
        self.check()  # the lent blocks are still taken on the prefill side
        while not self.d.transport.copied(self.tag):
            pass
        assert self.p.abort(self.origin[dsid])  # release_kv

    def check(self):
        self.p.block_manager.check_integrity(self.p.block_tables())
        self.d.block_manager.check_integrity(self.d.block_tables())


@pytest.fixture(params=["push", "pull"])
def way(request):
    return request.param


def test_prefill_here_decode_there_equals_one_engine(way):
    want = run_one(PROMPTS, params())
    pair = Pair(way)
    toks, text, reasons = pair.run(PROMPTS, params())
    assert (toks, text) == want
    assert reasons == ["length"] * len(PROMPTS)
    assert pair.p.transfer.num_transfers == len(PROMPTS) == pair.d.transfer.num_transfers
    assert pair.p.block_manager.num_used_blocks == 0 and not pair.p.held and not pair.p.lent
    assert pair.d.block_manager.num_used_blocks == 0 and not pair.d.arriving
    assert pair.p.scheduler.prefix_cache_hits > 0  # prompts 0 and 3 share two blocks on the prefill side
    assert pair.d.stats.prompt_tokens == 0  # no prompt was computed on the decode side


def test_a_full_decode_pool_makes_arrivals_wait(way):
    want = run_one(PROMPTS * 2, params(max_tokens=12))
    pair = Pair(way, decode_blocks=9)  # room for about two sequences at a time
    toks, text, reasons = pair.run(PROMPTS * 2, params(max_tokens=12))
    assert (toks, text) == want
    assert pair.max_blocked >= 2  # sequences waited for blocks
    # growing decodes may still preempt one another (recomputed on the decode side, same tokens)
    assert pair.d.block_manager.num_used_blocks == 0 and not pair.d.arriving and not pair.p.held


def test_abort_while_held_frees_prefill_blocks(way):
    pair = Pair(way)

    def abort_on_prefill(pair, dsid):
        assert pair.p.block_manager.num_used_blocks > 0
        assert pair.p.abort(pair.origin[dsid])

    toks, _, reasons = pair.run(PROMPTS[:1], params(), on_ready=abort_on_prefill)
    assert pair.p.block_manager.num_used_blocks == 0 and not pair.p.held
    assert pair.d.block_manager.num_used_blocks == 0 and not pair.d.arriving
    assert len(toks[0]) == 1 and reasons == [None]  # the decode side was aborted before it decoded


def handed_off(pair: Pair, dsid: int = 5000):
    """PROMPTS[0] prefilled on pair.p (its blocks held) and given blocks on pair.d as `dsid`."""
    seq = pair.add(PROMPTS[0], params())
    (out,) = pair.p.step()
    assert out.finish_reason == HANDOFF and pair.p.held
    pair.d.add_request(PROMPTS[0] + out.new_token_ids,
                       dataclasses.replace(params(), kv_transfer=KVTransferParams(remote_tokens=len(PROMPTS[0]))),
                       seq_id=dsid)
    assert [o.new_token_ids for o in pair.d.step()] == [[]]  # ready
    return seq


def test_an_abort_on_the_decode_side_after_the_send_frees_both_sides(way):
    """Push: the receive drains the sent pages; pull: nothing is copied, and the server gives the
    lent blocks back."""
    pair = Pair(way)
    seq = handed_off(pair)
    assert pair.d.block_manager.num_used_blocks == 3  # 9 prompt tokens + 1: three blocks of 4
    sent = pair.p.send_kv(seq.seq_id, 1, 1)
    assert (sent.lent is not None) == (way == "pull") and not pair.p.held
    assert pair.d.abort(5000) and pair.d.block_manager.num_used_blocks == 0
    got = pair.d.receive_kv(5000, 0, 1, sent.num_blocks, sent.lent)
    assert got.discarded and not got.landing and not pair.mailbox
    if sent.lent is not None:
        assert got.num_bytes == 0 and pair.p.block_manager.num_used_blocks == 3
        assert pair.p.abort(seq.seq_id)  # release_kv
    assert pair.p.block_manager.num_used_blocks == 0
    assert not pair.d.has_unfinished()
    pair.check()


def test_lent_blocks_of_another_count_fail_the_receive_and_free_the_decode_blocks():
    pair = Pair("pull")
    seq = handed_off(pair)
    sent = pair.p.send_kv(seq.seq_id, 1, 1)
    with pytest.raises(ValueError, match="blocks sent"):
        pair.d.receive_kv(5000, 0, 1, sent.num_blocks, sent.lent[:-1])
    assert pair.d.block_manager.num_used_blocks == 0 and not pair.d.arriving


def test_a_first_token_that_ends_the_request_keeps_nothing():
    pair = Pair()
    want, _ = run_one([PROMPTS[1]], params())
    first = want[0][0]
    # the first token as a stop token: the prefill side finishes it and keeps no blocks
    toks, _, reasons = pair.run([PROMPTS[1]], params(stop_token_ids=[first]))
    assert toks == [[first]] and reasons == ["stop"]
    assert not pair.p.held and pair.p.block_manager.num_used_blocks == 0 and not pair.d.arriving


def test_remote_tokens_must_leave_a_generated_token():
    d, _ = make(DecodeCore)
    with pytest.raises(ValueError):
        d.add_request([1, 2, 3], dataclasses.replace(params(), kv_transfer=KVTransferParams(remote_tokens=3)))


def test_a_prefill_pool_full_of_held_blocks_waits_for_a_command_instead_of_spinning(way):
    pair = Pair(way)
    pair.p, _ = make(PrefillCore, num_blocks=3)
    pair.p.transport = FakeTransport(FakePool(3), 0, pair.mailbox, pair.pools)
    first = pair.add(PROMPTS[0], params())  # 9 tokens: all three blocks
    (out,) = pair.p.step()
    assert out.finish_reason == HANDOFF and pair.p.block_manager.num_free_blocks == 0
    pair.add(PROMPTS[1], params())
    assert pair.p.has_unfinished()
    assert pair.p.step() == []  # no block for the new prompt
    assert not pair.p.has_unfinished()  # nothing to do until a command frees blocks
    if pair.p.send_kv(first.seq_id, 1, 1).lent is not None:  # lent: taken until the server releases them
        pair.add(PROMPTS[2], params())  # a new prompt: the engine looks again, and finds no block
        assert pair.p.has_unfinished() and pair.p.step() == []
        assert not pair.p.has_unfinished()
        assert pair.p.abort(first.seq_id)
    assert pair.p.has_unfinished()  # pushed or released: the blocks are free
    outs = pair.p.step()
    assert outs and all(o.finish_reason == HANDOFF for o in outs)


def test_a_stop_string_across_the_handoff_ends_the_text_as_one_engine():
    (toks,), _ = run_one([PROMPTS[0]], params())
    stop = [f"{toks[0]} {toks[1]}"[1:]]  # from inside the prefill's token into the decode's first
    want = run_one([PROMPTS[0]], params(stop=stop))
    _, text, reasons = Pair().run([PROMPTS[0]], params(stop=stop))
    assert text == want[1] and reasons == ["stop"]
    assert want[1] == [f" {toks[0]}"[:2]]  # the text ends where the stop string starts
