"""Penalties, logit_bias, min_p and min_tokens (engine/logit_adjust.py): the device path against its
plain reference and against transformers' processors of the same meaning; in the engine, greedy
outputs against a step-by-step loop over transformers' model with the reference applied, with and
without async scheduling, chunked prefills and preemption."""
import math
import random

import pytest
import torch

from engine.logit_adjust import LogitAdjuster, adjust_reference
from scheduler.request import SamplingParams, ScheduledSeq, Sequence, SequenceStatus
from serve import LLM
from tests.models import VOCAB

V = 40


def _row(sid, prompt, outputs, params, eos=frozenset({2})):
    """A sampling row whose sequence has `outputs` generated (known on the host)."""
    seq = Sequence(sid, prompt, params, eos_token_ids=eos)
    seq.token_ids += outputs
    end = len(prompt) + len(outputs)
    return ScheduledSeq(seq, end - 1, 1)


def _random_params(rng):
    kw = {"temperature": rng.choice([0.0, 0.7, 1.3]), "max_tokens": 50}
    if rng.random() < 0.5:
        kw["repetition_penalty"] = rng.choice([0.8, 1.3, 2.0])
    if rng.random() < 0.5:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.5:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 4))}
    if rng.random() < 0.4:
        kw["min_p"] = rng.choice([0.05, 0.3, 1.0])
    if rng.random() < 0.3:
        kw["allowed_token_ids"] = rng.sample(range(V), rng.randrange(1, 6))
    if rng.random() < 0.4:
        kw["min_tokens"] = rng.randrange(1, 6)
        kw["stop_token_ids"] = [rng.randrange(V)]
        kw["ignore_eos"] = rng.random() < 0.3
    return SamplingParams(**kw)


@pytest.mark.parametrize("seed", range(6))
def test_apply_equals_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n = 7
    params = [_random_params(rng) for _ in range(n - 1)] + [SamplingParams(temperature=0)]  # one row untouched
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 12))] for _ in range(n)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 9))] for _ in range(n)]
    items = [_row(i, prompts[i], outputs[i], params[i]) for i in range(n)]
    logits = (torch.randn(n, V) * 3).to(torch.bfloat16)
    got, _ = LogitAdjuster().apply(logits, items)
    want = adjust_reference(logits, params, prompts, outputs, [frozenset({2})] * n)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[-1], logits[-1].float())


def _sampling_at(seq, k):
    """seq's row of the step that samples its output token k: its prompt (k = 0) or a decode."""
    n = seq.num_prompt_tokens
    return ScheduledSeq(seq, n + k - 1, 1) if k else ScheduledSeq(seq, 0, n)


@pytest.mark.parametrize("steps", [1, 3])
def test_tokens_are_counted_as_sampled_not_when_the_host_has_them(steps):
    """Async scheduling: a row's last token is still on its way to the host when the next step samples;
    multi-step rounds (steps > 1): several are. The counts follow what was sampled on the device."""
    rng = random.Random(steps)
    params = [SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.5, frequency_penalty=0.4,
                             presence_penalty=0.3, min_tokens=6, stop_token_ids=[3]),
              SamplingParams(max_tokens=40, temperature=0, presence_penalty=-1.0),
              SamplingParams(max_tokens=40, temperature=0)]
    prompts = [[rng.randrange(V) for _ in range(5)] for _ in params]
    seqs = [Sequence(i, prompts[i], p, eos_token_ids=frozenset({2})) for i, p in enumerate(params)]
    adjuster = LogitAdjuster()
    sampled: list[list[int]] = [[] for _ in seqs]
    for _ in range(4):
        # the round's rows: every sequence's tokens but the last round's are on the host
        items = [_sampling_at(seq, len(sampled[i])) for i, seq in enumerate(seqs)]
        for step in range(steps):
            logits = torch.randn(len(seqs), V)
            got, count = adjuster.apply(logits, items, step)
            want = adjust_reference(logits, params, prompts, sampled, [frozenset({2})] * len(seqs))
            torch.testing.assert_close(got, want)
            tokens = got.argmax(dim=1)
            count(tokens)
            for i, t in enumerate(tokens.tolist()):
                sampled[i].append(t)
        for i, seq in enumerate(seqs):  # the host learns the round's tokens only after the next round
            seq.token_ids[seq.num_prompt_tokens:] = sampled[i][:-steps]
    assert adjuster.num_slots == 2


def test_slots_are_freed_and_taken_again():
    adjuster = LogitAdjuster()
    p = SamplingParams(presence_penalty=1.0)
    items = [_row(i, [1, 2], [5, 5, 7], p) for i in range(10)]  # more than the first 8 slots
    adjuster.apply(torch.zeros(10, V), items)
    assert adjuster.num_slots == 10
    for it in items[:6]:
        it.seq.status = SequenceStatus.FINISHED
    del it
    fresh = [_row(20, [1], [], p)]
    adjuster.apply(torch.zeros(1, V), fresh)
    assert adjuster.num_slots == 5
    items = None
    got, _ = adjuster.apply(torch.zeros(1, V), fresh)
    assert adjuster.num_slots == 1  # the others' sequences are gone (a follower drops its copies)
    assert torch.equal(got, torch.zeros(1, V))


def test_same_meaning_as_transformers_processors():
    from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                              RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                              TemperatureLogitsWarper)

    torch.manual_seed(0)
    prompt, outputs = [3, 7, 7, 11], [12, 3, 30]
    ids = torch.tensor([prompt + outputs])
    logits = torch.randn(1, V) * 2

    def ours(**kw):
        p = SamplingParams(max_tokens=20, **kw)
        return LogitAdjuster().apply(logits, [_row(0, prompt, outputs, p, eos=frozenset({5}))])[0]

    want = RepetitionPenaltyLogitsProcessor(1.4)(ids, logits.clone())
    torch.testing.assert_close(ours(repetition_penalty=1.4), want)
    want = SequenceBiasLogitsProcessor({(9,): 4.0, (3,): -2.5})(ids, logits.clone())
    torch.testing.assert_close(ours(logit_bias={9: 4.0, 3: -2.5}), want)
    # min_p after the temperature: the tokens HF's warper keeps are the ones we keep
    t = 0.7
    scaled = TemperatureLogitsWarper(t)(ids, logits.clone())
    kept = MinPLogitsWarper(0.2)(ids, scaled).isfinite()
    assert torch.equal(ours(temperature=t, min_p=0.2).isfinite(), kept)
    # min_tokens bans end-of-sequence (and the stop tokens) while fewer are out
    want = MinNewTokensLengthLogitsProcessor(len(prompt), 5, [5, 8])(ids, logits.clone())
    torch.testing.assert_close(ours(min_tokens=5, stop_token_ids=[8]), want)
    torch.testing.assert_close(ours(min_tokens=3, stop_token_ids=[8]), logits)  # 3 are out: no ban


def hf_adjusted_greedy(path, prompt, params, eos, steps):
    """Transformers' model, one token at a time, the reference adjustments before each argmax;
    stops on a stop token or end-of-sequence as the engine does."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out])).logits[:, -1]
            tok = int(adjust_reference(logits, [params], [prompt], [out], [eos]).argmax())
            out.append(tok)
            if tok in params.stop_token_ids or (not params.ignore_eos and tok in eos):
                break
    return out


def check_drained(llm, preempted: bool) -> None:
    """After generate(): nothing left in the engine, every KV block free, and (a small cache) preemptions."""
    core = llm.engine.core
    assert not core.has_unfinished()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    if preempted:
        assert core.stats.num_preemptions > 0


def _params():
    return [
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=-0.8, repetition_penalty=0.9),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logit_bias={17: 3.0, 40: -50.0}),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, min_p=0.5),  # greedy: no effect
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, allowed_token_ids=[9, 40, 77, 300],
                       presence_penalty=0.8),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    ]


@pytest.mark.parametrize("kw", [
    {"async_scheduling": True},
    {"async_scheduling": False},
    {"async_scheduling": True, "max_num_batched_tokens": 32},
    {"async_scheduling": True, "num_kv_blocks": 10},
], ids=["async", "sync", "chunked", "preempt"])
def test_engine_greedy_equals_transformers_step_by_step(tiny_models, kw):
    path = tiny_models["llama"]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(6, 40))] for _ in _params()]
    params = _params()
    llm = LLM(str(path), dtype="float32", device="cpu", **kw)
    outs = llm.generate(prompts, params)
    check_drained(llm, preempted="num_kv_blocks" in kw)
    eos = llm.engine.core.eos_token_ids
    for prompt, p, o in zip(prompts, params, outs):
        assert o.token_ids == hf_adjusted_greedy(path, prompt, p, eos, p.max_tokens), p
    # the repetition and presence penalties and the bias do change the output (the third row encourages
    # repeats: unchanged)
    plain = llm.generate(prompts, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    assert all(plain[i].token_ids != outs[i].token_ids for i in (0, 1, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [1, 4])
def test_gpu_engine_greedy_equals_transformers_step_by_step(tiny_models, steps):
    """On the GPU (float32, decode graphs, whole-step graphs, async scheduling, multi-step rounds or
    not): each sampled token is counted on the device as it is sampled."""
    path = tiny_models["llama"]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(6, 40))] for _ in _params()]
    params = _params()
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=48, num_scheduler_steps=steps)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.num_scheduler_steps == steps
    outs = llm.generate(prompts, params)
    eos = llm.engine.core.eos_token_ids
    for prompt, p, o in zip(prompts, params, outs):
        assert o.token_ids == hf_adjusted_greedy(path, prompt, p, eos, p.max_tokens), p


def test_min_tokens_holds_back_the_stop_token(tiny_models):
    path = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", device="cpu")
    prompt = [5, 9, 33, 70, 101, 7]
    free = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop = free[1]
    early = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop],
                                                ignore_eos=True))[0]
    assert early.token_ids[-1] == stop and len(early.token_ids) <= 2
    p = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop], ignore_eos=True, min_tokens=5)
    held = llm.generate(prompt, p)[0]
    assert stop not in held.token_ids[:5] and len(held.token_ids) >= 5
    assert held.token_ids == hf_adjusted_greedy(path, prompt, p, llm.engine.core.eos_token_ids, 10)


def test_min_p_samples_only_likely_tokens_and_logprobs_stay_the_models(tiny_models):
    """Sampled rows keep to min_p of the adjusted distribution; logprobs are the model's own."""
    import transformers

    path = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", device="cpu")
    prompt = [5, 9, 33, 70, 101, 7]
    p = SamplingParams(max_tokens=12, temperature=1.5, min_p=0.3, seed=3, ignore_eos=True, logprobs=1,
                       logit_bias={11: 2.0})
    out = llm.generate([prompt] * 4, [SamplingParams(**{**p.__dict__, "seed": s}) for s in range(4)])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for o in out:
            ids = prompt + o.token_ids
            logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
            raw = logits.log_softmax(-1)
            biased = logits + torch.nn.functional.one_hot(torch.tensor(11), logits.shape[1]) * 2.0
            adjusted = (biased / 1.5).softmax(-1)
            for k, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
                assert adjusted[k, tok] >= 0.3 * adjusted[k].max() * (1 - 1e-5)
                assert math.isclose(lp.logprob, float(raw[k, tok]), abs_tol=1e-4)
