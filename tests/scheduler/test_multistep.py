"""Multi-step scheduling (SchedulerConfig.num_scheduler_steps) with a fake executor: several decode
steps per batch give the same tokens as one step per batch, never run past a sequence's end by
length, drop what follows a stop token, and fall back to one step where they must."""
from kvcache.block_manager import BlockManager
from scheduler.policy import Scheduler, SchedulerConfig
from scheduler.request import SampleOutput, SamplingParams, Sequence


def make(steps, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256, caching=False):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, caching, 0.0, steps), bm)


def seq(sid, n, max_tokens=10, temperature=0.0, **kw):
    return Sequence(sid, list(range(100, 100 + n)),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, **kw), max_model_len=256)


def fake_execute(batch):
    """The token sampled at position p is 1000 + p + 1 (as tests/scheduler/test_policy.py's): every
    step of a multi-step batch one position further."""
    out = []
    for it in batch.items:
        if not it.samples:
            out.append(None)
            continue
        toks = [1000 + it.end + j for j in range(batch.num_steps)]
        out.append(SampleOutput(toks[0], None, toks[1:] if batch.num_steps > 1 else None))
    return out


def run(s, seqs, overlap=False):
    """Add seqs, step until done -> (batches' num_steps, outputs per seq id). overlap: schedule
    the next batch before updating the last (async scheduling)."""
    for q in seqs:
        s.add(q)
    steps, streamed = [], {q.seq_id: [] for q in seqs}
    prev = None
    for _ in range(1000):
        b = s.schedule()
        if b is not None:
            steps.append(b.num_steps)
        if not overlap and b is not None:
            prev, b = b, None
        if prev is not None:
            for o in s.update(prev, fake_execute(prev)):
                streamed[o.seq_id] += o.new_token_ids
            s.check_integrity()
        prev = b
        if b is None and not s.num_unfinished:
            break
    return steps, streamed


def test_same_tokens_fewer_batches():
    for overlap in (False, True):
        one = [seq(i, 3 + i, max_tokens=9 + 2 * i) for i in range(4)]
        many = [seq(i, 3 + i, max_tokens=9 + 2 * i) for i in range(4)]
        steps1, out1 = run(make(1), one, overlap)
        steps4, out4 = run(make(4), many, overlap)
        assert [q.output_token_ids for q in many] == [q.output_token_ids for q in one]
        assert out4 == out1 == {q.seq_id: q.output_token_ids for q in one}
        assert all(len(q.output_token_ids) == q.params.max_tokens and q.finish_reason == "length" for q in many)
        assert max(steps4) == 4 and len(steps4) < len(steps1) and set(steps1) == {1}


def test_never_past_the_end_by_length():
    s = make(8, max_model_len=20)
    a, b = seq(0, 4, max_tokens=6), seq(1, 12, max_tokens=100)  # b ends by the model's length
    steps, _ = run(s, [a, b])
    assert len(a.output_token_ids) == 6 and len(b.token_ids) == 20
    assert a.finish_reason == b.finish_reason == "length"
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_stop_token_drops_the_rest_and_frees_blocks():
    s = make(4)
    # prompt of 5: the prefill samples 1005, the first 4-step batch 1006-1009
    a = seq(0, 5, max_tokens=20, stop_token_ids=[1007])
    steps, out = run(s, [a], overlap=True)
    assert steps[:2] == [1, 4]
    assert a.output_token_ids == [1005, 1006, 1007] and a.finish_reason == "stop"
    assert out[0] == [1005, 1006, 1007]
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.running


def test_one_step_where_it_must():
    # rows with logprobs; a sampled row does not stop the rounds (the runner samples every step)
    steps, _ = run(make(4), [seq(0, 3), seq(1, 3, logprobs=2)])
    assert set(steps) == {1}
    steps, _ = run(make(4), [seq(0, 3), seq(1, 3, temperature=0.7)])
    assert 4 in steps
    # nor do rows whose logits are adjusted (engine/logit_adjust.py counts their tokens on the device)
    for kw in ({"presence_penalty": 0.5}, {"repetition_penalty": 1.2}, {"logit_bias": {5: 1.0}}, {"min_tokens": 2},
               {"temperature": 0.7, "min_p": 0.1}):
        steps, _ = run(make(4), [seq(0, 3), seq(1, 3, **kw)])
        assert 4 in steps, kw
    # a prompt waiting for a free slot (max_num_seqs) does not stop the rounds: they end where
    # sequences end by length, so it starts as soon as it could have
    s = make(4, max_num_seqs=1)
    a, b = seq(0, 3, max_tokens=9), seq(1, 3, max_tokens=9)
    steps, _ = run(s, [a, b])
    assert steps == [1, 4, 4, 1, 4, 4]
    assert a.output_token_ids == [1003 + i for i in range(9)] == b.output_token_ids
    # no room for the blocks of more steps: one free block, two rows that would need one each
    s = make(4, num_blocks=3, block_size=4)
    a, b = seq(0, 3, max_tokens=5), seq(1, 3, max_tokens=5)
    steps, _ = run(s, [a, b])
    assert steps[:2] == [1, 1]
    assert a.output_token_ids == b.output_token_ids == [1003 + i for i in range(5)]
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_prefix_cache_registers_blocks_of_every_step():
    def cached_blocks(steps):
        s = make(steps, caching=True)
        a = seq(0, 5, max_tokens=15)
        run(s, [a])
        again = Sequence(1, a.token_ids[:-1], SamplingParams(max_tokens=1), max_model_len=256)
        return len(s.bm.match_prefix(again.token_ids, again.block_hashes))
    assert cached_blocks(4) == cached_blocks(1) == (5 + 15 - 1) // 4


def test_prompts_and_decode_rounds_take_turns():
    """With prompts arriving all the time, a step with prompt tokens and a round of K decode steps
    alternate: prompts wait one round at most, and the host's work is paid once per round."""
    s = make(4, max_num_seqs=8, budget=64)
    for q in [seq(i, 3, max_tokens=30) for i in range(2)]:
        s.add(q)
    kinds = []
    for i in range(12):
        if i % 2 == 0:
            s.add(seq(10 + i, 5, max_tokens=30))  # a new prompt before every other step
        b = s.schedule()
        kinds.append((b.num_steps, any(not it.num_new_tokens == 1 for it in b.items)))
        s.update(b, fake_execute(b))
        s.check_integrity()
    # (steps, carries a prompt): a prompt step, then a round of 4 decode steps, and again
    assert kinds[:6] == [(1, True), (4, False), (1, True), (4, False), (1, True), (4, False)]
