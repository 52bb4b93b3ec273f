"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read) gives the
same tokens as waiting for each step: float32 on the CPU, where the pipeline is forced on."""
import random

import pytest

from serve import LLM, SamplingParams
from tests.models import VOCAB


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def params_mix():
    return [
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),  # done at its prefill
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0),  # may stop on EOS
    ]


def generate(path, async_scheduling, ps, params, **kw):
    llm = LLM(str(path), dtype="float32", device="cpu", async_scheduling=async_scheduling, **kw)
    outs = llm.generate(ps, params)
    core = llm.engine.core
    assert not core.has_unfinished()
    core.scheduler.check_integrity()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return outs, core


def summary(outs):
    return [(o.token_ids, o.finish_reason, o.text,
             [(lp.token_id, round(lp.logprob, 4)) for lp in (o.logprobs or [])]) for o in outs]


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 32},  # chunked prefills next to decodes
    {"num_kv_blocks": 10},  # preemption while a step is in flight
    {"enable_prefix_caching": False},
], ids=["plain", "chunked", "preempt", "no-prefix-cache"])
def test_async_equals_sync(tiny_models, kw):
    ps = prompts()
    want, _ = generate(tiny_models["llama"], False, ps, params_mix(), **kw)
    got, core = generate(tiny_models["llama"], True, ps, params_mix(), **kw)
    assert summary(got) == summary(want)
    if kw.get("num_kv_blocks"):
        assert core.stats.num_preemptions > 0


def test_async_stop_token_and_stop_string(tiny_models):
    """A sequence that stops on a token or a string while its next step is in flight: that
    step's token is dropped, the outputs equal the synchronous run's."""
    ps = prompts(4, seed=3)
    free, _ = generate(tiny_models["llama"], False, ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    # stop on the 5th generated token of each prompt, and on the text of the 8th
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[o.token_ids[4]]) for o in free]
    params += [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[o.text[-3:]]) for o in free if o.text[-3:].strip()]
    ps2 = ps + ps[:len(params) - len(ps)]
    want, _ = generate(tiny_models["llama"], False, ps2, params)
    got, core = generate(tiny_models["llama"], True, ps2, params)
    assert summary(got) == summary(want)
    assert all(len(o.token_ids) <= 5 for o in got[:len(ps)])


class Spy:
    """Records the order of launch/collect calls of the runner it wraps."""

    def __init__(self, runner):
        self.runner, self.calls, self.overlap = runner, [], True

    def launch(self, batch, prev):
        self.calls.append(("launch", len(self.calls)))
        return self.runner.launch(batch, prev)

    def collect(self, handle):
        self.calls.append(("collect", len(self.calls)))
        return self.runner.collect(handle)

    def execute(self, batch):
        raise AssertionError("the pipelined path never calls execute")


def test_next_step_is_launched_before_the_previous_is_collected(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", async_scheduling=True)
    core = llm.engine.core
    spy = Spy(core.executor)
    core.executor = spy
    core.add_request(prompts(1)[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert core.step() == []  # step 1 launched (the prefill), nothing collected yet
    outs = core.step()  # step 2 (first decode) launched, then step 1's token collected
    assert [kind for kind, _ in spy.calls] == ["launch", "launch", "collect"]
    assert len(outs) == 1 and len(outs[0].new_token_ids) == 1
    tokens = list(outs[0].new_token_ids)
    while core.has_unfinished():
        for o in core.step():
            tokens += o.new_token_ids
    assert len(tokens) == 4
    # max_tokens 4 = the prefill's token + 3 decodes: no step is launched for a token past the limit
    assert [kind for kind, _ in spy.calls].count("launch") == 4


def test_abort_while_in_flight_frees_blocks(tiny_models):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", async_scheduling=True)
    core = llm.engine.core
    seqs = [core.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in prompts(3)]
    core.step()
    core.step()
    assert core.abort(seqs[1].seq_id)  # its next decode is in flight
    while core.has_unfinished():
        for o in core.step():
            assert o.seq_id != seqs[1].seq_id
    core.scheduler.check_integrity()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert [len(s.output_token_ids) for s in (seqs[0], seqs[2])] == [30, 30]
