"""Scheduler policy with a fake executor (torch-free, milliseconds)."""
import pytest

from kvcache.block_manager import BlockManager
from scheduler.policy import HOLD_CAP, RequestRejected, Scheduler, SchedulerConfig
from scheduler.request import SampleOutput, SamplingParams, Sequence


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=False, hold_s=0.0):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, caching, hold_s), bm)


def seq(sid, n, max_tokens=4, **kw):
    return Sequence(sid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
                    max_model_len=256)


def fake_execute(batch):
    """Next token = 1000 + position, so outputs are checkable."""
    return [SampleOutput(1000 + it.end) if it.samples else None for it in batch.items]


def run_all(s, max_steps=1000):
    steps = []
    for _ in range(max_steps):
        b = s.schedule()
        if b is None:
            break
        steps.append([(it.seq.seq_id, it.start, it.num_new_tokens) for it in b.items])
        s.update(b, fake_execute(b))
        s.check_integrity()
    return steps


def test_decodes_first_then_chunked_prefill_within_budget():
    s = make(budget=10)
    a, b = seq(0, 3), seq(1, 25)
    s.add(a)
    s.add(b)
    steps = run_all(s)
    assert steps[0] == [(0, 0, 3), (1, 0, 7)]  # a's whole prompt, then a chunk of b
    assert steps[1] == [(0, 3, 1), (1, 7, 9)]  # a decodes first, b gets the rest of the budget
    assert all(sum(n for _, _, n in st) <= 10 for st in steps)
    assert a.output_token_ids == [1000 + 3 + i for i in range(4)]
    assert a.finish_reason == b.finish_reason == "length"


def test_max_num_seqs_and_fcfs():
    s = make(max_num_seqs=2)
    seqs = [seq(i, 2, max_tokens=3) for i in range(5)]
    for q in seqs:
        s.add(q)
    steps = run_all(s)
    assert all(len(st) <= 2 for st in steps)
    first_seen = {}
    for i, st in enumerate(steps):
        for sid, _, _ in st:
            first_seen.setdefault(sid, i)
    assert sorted(first_seen, key=first_seen.get) == [0, 1, 2, 3, 4]
    assert all(q.is_finished for q in seqs)


def test_preemption_newest_first_requeued_at_front_and_outputs_unchanged():
    # 3 sequences of 8 prompt tokens growing to 16 need 4 blocks of 4 each; 9 blocks fit 2 of them.
    s = make(num_blocks=9, budget=64)
    seqs = [seq(i, 8, max_tokens=8) for i in range(3)]
    for q in seqs:
        s.add(q)
    b = s.schedule()
    assert [it.seq.seq_id for it in b.items] == [0, 1, 2]
    s.update(b, fake_execute(b))
    while s.num_preemptions == 0:  # growth past 12 tokens: 2, the newest, is preempted first
        b = s.schedule()
        s.update(b, fake_execute(b))
    assert [q.seq_id for q in s.waiting] == [2] and seqs[2].num_computed_tokens == 0
    run_all(s)
    for q in seqs:
        assert q.output_token_ids == [1000 + 8 + i for i in range(8)]
    assert s.bm.num_free_blocks == 9


def test_request_that_never_fits_is_rejected_with_reason():
    s = make(num_blocks=4, block_size=4)
    with pytest.raises(RequestRejected, match="needs up to"):
        s.add(seq(0, 10, max_tokens=10))
    with pytest.raises(RequestRejected, match="context length"):
        make().add(Sequence(1, list(range(300)), SamplingParams(), max_model_len=256))
    with pytest.raises(RequestRejected, match="empty"):
        make().add(Sequence(2, [], SamplingParams()))


def test_abort_frees_blocks_everywhere():
    s = make(max_num_seqs=1)
    a, b = seq(0, 5), seq(1, 5)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    s.update(batch, fake_execute(batch))
    assert s.abort(0) and s.abort(1) and not s.abort(1)
    assert s.bm.num_free_blocks == s.bm.num_blocks
    assert a.finish_reason == "abort" and s.num_unfinished == 0
    s.check_integrity()


def test_no_starvation_under_pressure():
    s = make(num_blocks=12, max_num_seqs=4, budget=16)
    seqs = [seq(i, 3 + (i * 7) % 13, max_tokens=6 + i % 5) for i in range(20)]
    for q in seqs:
        s.add(q)
    run_all(s, max_steps=5000)
    assert all(q.is_finished and q.finish_reason == "length" for q in seqs)
    assert s.bm.num_free_blocks == 12


def test_prefix_cache_counts_cached_tokens_as_computed():
    s = make(caching=True, budget=64)
    a = seq(0, 13, max_tokens=2)
    s.add(a)
    run_all(s)
    b = Sequence(1, a.prompt_token_ids[:12] + [7, 8], SamplingParams(max_tokens=2, ignore_eos=True), max_model_len=256)
    s.add(b)
    batch = s.schedule()
    assert [(it.start, it.num_new_tokens) for it in batch.items] == [(12, 2)]  # 3 full blocks hit
    assert b.num_cached_tokens == 12
    s.update(batch, fake_execute(batch))
    run_all(s)
    # The exact same prompt: all blocks hit, but the last block is recomputed to get logits.
    c = Sequence(2, list(a.prompt_token_ids[:12]), SamplingParams(max_tokens=1, ignore_eos=True), max_model_len=256)
    s.add(c)
    batch = s.schedule()
    assert [(it.start, it.num_new_tokens) for it in batch.items] == [(8, 4)]
    assert s.prefix_cache_hits == 12 + 8


def test_requests_admitted_in_one_step_share_a_prefix_computed_in_that_step():
    s = make(caching=True, budget=64)
    a = seq(0, 14, max_tokens=2)
    b = Sequence(1, a.prompt_token_ids[:12] + [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True), max_model_len=256)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    # a computes its 14 tokens; b shares a's first 3 blocks, written by the same step's layers
    # before any attention reads them, and computes only its own 3 tokens.
    assert [(it.seq.seq_id, it.start, it.num_new_tokens) for it in batch.items] == [(0, 0, 14), (1, 12, 3)]
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == 12
    s.update(batch, fake_execute(batch))
    s.check_integrity()


def test_a_failed_step_leaves_nothing_cached_it_did_not_compute():
    s = make(caching=True, budget=64)
    a = seq(0, 14, max_tokens=2)
    s.add(a)
    batch = s.schedule()
    assert len(s.bm.cached) == 3
    s.discard(batch)
    assert len(s.bm.cached) == 0
    s.abort(0)
    s.check_integrity()


def _decoding(s, n=2):
    """n sequences past their prefill, so the next step decodes them."""
    for i in range(n):
        sq = seq(100 + i, 3, max_tokens=50)
        sq.arrival_time = 0.0  # long ago: no prefill hold
        s.add(sq)
    b = s.schedule()
    s.update(b, fake_execute(b))
    return s


def _new(s, b):
    return [it.seq.seq_id for it in b.items if it.start == 0]


def _arrive(s, sid, n, t, **kw):
    sq = seq(sid, n, **kw)
    sq.arrival_time = t
    s.add(sq)


def test_prefill_hold_waits_for_the_rest_of_a_burst():
    """While sequences decode, new prompts wait until none has arrived for the quiet time, then
    start together in one prefill."""
    s = _decoding(make(budget=64, hold_s=0.05))
    _arrive(s, 0, 5, 10.0)
    b = s.schedule(now=10.01)
    assert b.num_decode == 2 and _new(s, b) == []  # decodes only: the burst is arriving
    assert s.hold_release == 10.05
    s.update(b, fake_execute(b))
    _arrive(s, 1, 5, 10.03)
    _arrive(s, 2, 5, 10.04)
    b = s.schedule(now=10.08)  # 40 ms after the last one: still within its quiet time
    assert _new(s, b) == [] and s.hold_release == 10.09
    s.update(b, fake_execute(b))
    b = s.schedule(now=10.09)
    assert _new(s, b) == [0, 1, 2] and b.num_decode == 2 and s.hold_release is None
    assert s.num_held_steps == 2
    s.update(b, fake_execute(b))
    s.check_integrity()


def test_prefill_hold_is_bounded_by_time():
    """A stream that never pauses waits at most HOLD_CAP quiet times after its first prompt."""
    s = _decoding(make(budget=64, hold_s=0.05))
    for i in range(HOLD_CAP + 1):
        _arrive(s, i, 3, 10.0 + 0.04 * i)
        b = s.schedule(now=10.0 + 0.04 * i + 0.001)
        assert _new(s, b) == []
        s.update(b, fake_execute(b))
    assert s.hold_release == 10.0 + HOLD_CAP * 0.05
    b = s.schedule(now=s.hold_release)
    assert _new(s, b) == list(range(HOLD_CAP + 1))
    s.update(b, fake_execute(b))
    s.check_integrity()


def test_prefill_hold_ends_when_the_step_is_full():
    s = _decoding(make(budget=16, hold_s=1.0))
    _arrive(s, 0, 7, 10.0)
    assert _new(s, s.schedule(now=10.0)) == []
    _arrive(s, 1, 7, 10.0)  # 14 prompt tokens: a full step with the 2 decodes (budget 16)
    assert _new(s, s.schedule(now=10.0)) == [0, 1]
    s = _decoding(make(budget=64, max_num_seqs=4, hold_s=1.0))
    _arrive(s, 0, 3, 10.0)
    assert _new(s, s.schedule(now=10.0)) == []
    _arrive(s, 1, 3, 10.0)  # 2 decoding + 2 new: max_num_seqs
    assert _new(s, s.schedule(now=10.0)) == [0, 1]


def test_prefill_hold_on_an_idle_engine():
    """With nothing running the first prompts of a burst wait too (an idle engine sees them first);
    schedule() then has nothing to run and says until when. With the hold off (the default) nothing
    ever waits."""
    s = make(budget=64, hold_s=0.05)
    _arrive(s, 0, 5, 10.0)
    assert s.schedule(now=10.01) is None and s.hold_release == 10.05
    _arrive(s, 1, 5, 10.02)
    assert s.schedule(now=10.03) is None and s.hold_release == 10.07
    b = s.schedule(now=10.07)
    assert _new(s, b) == [0, 1] and s.hold_release is None
    s = _decoding(make(budget=64))
    s.add(seq(0, 5))
    assert _new(s, s.schedule(now=s.seqs[0].arrival_time)) == [0]
    assert s.num_held_steps == 0 and s.hold_release is None


def test_prefill_hold_never_holds_preempted_sequences():
    s = make(num_blocks=6, block_size=4, budget=64, hold_s=1.0)
    _arrive(s, 0, 8, 0.0, max_tokens=12)
    _arrive(s, 1, 8, 0.0, max_tokens=12)
    while not s.num_preemptions:  # long after the arrivals: nothing held, both grow until one is preempted
        b = s.schedule(now=100.0)
        s.update(b, fake_execute(b))
    assert s.waiting[0].num_preemptions
    b = s.schedule(now=0.0)  # "just arrived", but it is not new
    assert s.hold_release is None and s.num_held_steps == 0
    s.update(b, fake_execute(b))
    s.check_integrity()


# ---------------------------------------------------------------- stall-free batching: the prompt budget


def make_budgeted(prompt_budget, num_blocks=256, block_size=4, max_num_seqs=8, budget=64, paced=False):
    bm = BlockManager(num_blocks, block_size, False)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256, False, prompt_budget=prompt_budget, paced=paced), bm)


def test_prompt_tokens_beside_decodes_stay_within_the_budget():
    asked = []

    def prompt_budget(decodes, context, demand):
        asked.append((decodes, context, demand))
        return 5

    s = make_budgeted(prompt_budget)
    a, b, c = seq(0, 3, max_tokens=6), seq(1, 30), seq(2, 60)
    for q in (a, b, c):
        s.add(q)
    steps = run_all(s)
    # no decode yet: the whole token budget (a lone prompt runs at full speed)
    assert steps[0] == [(0, 0, 3), (1, 0, 30), (2, 0, 31)]
    # then the two decodes, and at most 5 prompt tokens beside them
    assert steps[1] == [(0, 3, 1), (1, 30, 1), (2, 31, 5)]
    assert all(sum(n for _, _, n in st if n > 1) <= 5 for st in steps[1:] if any(n == 1 for _, _, n in st))
    # the policy was asked with the decodes' count and their contexts (the new token included);
    # nothing waits, so the cache holds no prompt back
    assert asked[0] == (2, 4 + 31, None)
    assert a.finish_reason == b.finish_reason == c.finish_reason == "length"


def test_every_running_decode_is_scheduled_before_any_prompt_chunk():
    s = make_budgeted(lambda d, ctx, demand: 3, budget=16, max_num_seqs=8)
    # five short prompts become decodes; then a long prompt arrives
    for i in range(5):
        s.add(seq(i, 2, max_tokens=20))
    b = s.schedule()
    s.update(b, fake_execute(b))
    s.add(seq(9, 40))
    b = s.schedule()
    ids = [(it.seq.seq_id, it.num_new_tokens) for it in b.items]
    assert ids[:5] == [(i, 1) for i in range(5)]
    assert ids[5] == (9, 3)  # the prompt budget beside five decodes


def test_the_budget_is_told_the_demand_while_the_cache_holds_prompts_back():
    # 10 blocks of 4 tokens
    asked = []
    s = make_budgeted(lambda d, ctx, demand: asked.append(demand) or 8, num_blocks=10, budget=64, paced=True)
    first = seq(0, 6, max_tokens=2)  # ends first: 6 prompt tokens for 2 output tokens
    s.add(first)
    run_all(s)
    a = seq(1, 20, max_tokens=16)  # holds 6 blocks while it decodes
    s.add(a)
    b = s.schedule()
    s.update(b, fake_execute(b))
    s.add(seq(2, 12, max_tokens=2))  # 12 tokens fit the 16 free
    b = s.schedule()
    assert asked[-1] is None
    s.update(b, fake_execute(b))
    # 8 of the 12 went in; 8 tokens are free (2 blocks): two more prompts of 8 tokens do not fit, so
    # a step of one decode (a) needs 6 / 2 prompt tokens to keep pace with the sequences that end
    s.add(seq(3, 8, max_tokens=2))
    s.add(seq(4, 8, max_tokens=2))
    s.schedule()
    assert asked[-1] == 3


def test_the_budget_is_told_the_backlog_while_prompts_wait_to_start():
    # one GPU (not paced): prompts that wait for compute, not for blocks
    asked = []
    s = make_budgeted(lambda d, ctx, demand: asked.append(demand) or 4, budget=64, max_num_seqs=5)
    s.add(seq(0, 6, max_tokens=2))  # ends first: 6 prompt tokens for 2 output tokens
    run_all(s)
    assert asked == [None]  # its decode step: nothing waits, no backlog
    s.add(seq(1, 10, max_tokens=30))
    b = s.schedule()
    s.update(b, fake_execute(b))
    b = s.schedule()
    s.update(b, fake_execute(b))
    for i in range(2, 8):
        s.add(seq(i, 40, max_tokens=4))
    s.schedule()
    # 1 running + 6 waiting, of which 5 could run (max_num_seqs): 5 x 6 / 2 prompt tokens a step
    assert asked[-1] == 15
    # the budget was 4: one prompt started with a chunk, the other five still wait
    assert len(s.running) == 2 and len(s.waiting) == 5


def test_a_prompt_chunk_waits_for_blocks_while_decodes_run():
    # 10 blocks of 4 tokens: a decoding sequence of 20+ tokens holds 6, a 24-token prompt advances 8
    # tokens a step until no block is left for its next chunk; then it waits, keeping its blocks
    s = make_budgeted(lambda d, ctx, demand: 8, num_blocks=10, budget=64)
    a = seq(0, 20, max_tokens=16)
    s.add(a)
    b = s.schedule()
    s.update(b, fake_execute(b))
    long = seq(1, 24, max_tokens=2)
    s.add(long)
    chunks = []
    for _ in range(4):
        b = s.schedule()
        assert b.items[0].seq is a and b.items[0].num_new_tokens == 1  # the stream never stalls
        chunks.append(sum(it.num_new_tokens for it in b.items if it.seq is long))
        s.update(b, fake_execute(b))
        s.check_integrity()
    assert chunks == [8, 8, 0, 0] and s.num_preemptions == 0 and len(long.block_table) == 4
    run_all(s)
    assert a.finish_reason == long.finish_reason == "length"
