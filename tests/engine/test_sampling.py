"""Sampling parameters end to end, and the sampler itself."""
from collections import Counter

import pytest
import torch

from engine.sampler import SamplingBatch, apply_top_k_top_p, sample, sample_on_device
from serve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=128)


PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46]]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    a = llm.generate(PROMPTS, p)
    b = llm.generate(PROMPTS[:1] + [[9] * 30] + PROMPTS[1:], p)  # different batch mates
    assert a[0].token_ids == b[0].token_ids and a[1].token_ids == b[2].token_ids
    c = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=124, ignore_eos=True))
    assert [o.token_ids for o in c] != [o.token_ids for o in a]


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    topk1 = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=5.0, top_k=1, ignore_eos=True))
    tiny_p = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=5.0, top_p=1e-6, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1] == [o.token_ids for o in tiny_p]


def test_max_tokens_stop_token_ids_and_eos(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    toks = greedy[1].token_ids
    stop_at = toks[4]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.token_ids == toks[:toks.index(stop_at) + 1] and out.finish_reason == "stop"
    # the stop token's text is not the output's, unless include_stop_str_in_output (vLLM's rule), and
    # with skip_special_tokens false an end-of-sequence token's text is not either
    decode = llm.tokenizer.decode
    assert out.text == decode(out.token_ids[:-1]) != decode(out.token_ids)
    kept = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at],
                                                     ignore_eos=True, include_stop_str_in_output=True))[0]
    assert kept.text == decode(out.token_ids)
    # EOS: make the engine treat that token as EOS; ignore_eos turns it off again
    core = llm.engine.core
    saved = core.eos_token_ids
    core.eos_token_ids = frozenset([stop_at])
    try:
        out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0, skip_special_tokens=False))[0]
        assert out.token_ids == toks[:toks.index(stop_at) + 1] and out.finish_reason == "stop"
        assert out.text == decode(out.token_ids[:-1], skip_special_tokens=False)
        out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
        assert out.token_ids == toks and out.finish_reason == "length"
    finally:
        core.eos_token_ids = saved


def test_stop_strings_cut_text(llm):
    full = llm.generate(["Hello, world!"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate(["Hello, world!"], SamplingParams(max_tokens=16, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]


def test_invalid_params_raise_clear_errors():
    for bad, msg in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
                     (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)


def test_top_k_top_p_mask():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    probs = logits.softmax(-1)[0]
    p = float(probs[0] + probs[1]) - 1e-4  # nucleus needs the top two tokens
    out = apply_top_k_top_p(logits, torch.tensor([5]), torch.tensor([p]))
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, _ = sample(logits, SamplingBatch(params, [0] * 4000), torch.Generator().manual_seed(0))
    freq = Counter(tokens)
    assert abs(freq[0] / 4000 - 0.5) < 0.04 and abs(freq[1] / 4000 - 0.3) < 0.04 and freq[3] == 0


def test_top_p_top_k_sampling_follows_the_nucleus():
    """Inside the nucleus the tokens keep their odds; outside it none is drawn."""
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.05, 0.25]])).repeat(4000, 1)
    for kw, want in (({"top_p": 0.7}, {1: 0.5 / 0.75, 3: 0.25 / 0.75}), ({"top_k": 2}, {1: 0.5 / 0.75, 3: 0.25 / 0.75}),
                     ({"top_p": 0.9, "top_k": 3}, {1: 0.5 / 0.95, 3: 0.25 / 0.95, 0: 0.2 / 0.95})):
        params = [SamplingParams(temperature=1.0, **kw)] * 4000
        freq = Counter(sample(logits, SamplingBatch(params, [0] * 4000), torch.Generator().manual_seed(1))[0])
        assert set(freq) == set(want), kw
        for tok, p in want.items():
            assert abs(freq[tok] / 4000 - p) < 0.04, (kw, tok)


def test_a_seeded_rows_later_step_draws_as_its_later_position():
    """A multi-step round samples step j of a row at output position start + j: the same token as a
    single step at that position, so a seeded request does not depend on the rounds."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.9, top_p=0.8, seed=8),
              SamplingParams(temperature=0)]
    for j in (1, 3):
        later = sample_on_device(logits, SamplingBatch(params, [4, 9, 0]), step=j).to_host()[0]
        assert later == sample(logits, SamplingBatch(params, [4 + j, 9 + j, 0]))[0]
    draws = {tuple(sample_on_device(logits, SamplingBatch(params, [4, 9, 0]), step=j).to_host()[0]) for j in range(6)}
    assert len(draws) > 1


def test_row_seeds_for_the_sampling_kernel():
    """A seeded row's noise key comes from (seed, output position + step); the others' from the
    engine's generator, new every call."""
    from engine.sampler import _row_seeds, _seed_for

    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.9), SamplingParams(temperature=0, seed=3)]
    batch = SamplingBatch(params, [4, 9, 2])
    gen = torch.Generator().manual_seed(0)
    a, b = _row_seeds(batch, gen, 0, torch.device("cpu")), _row_seeds(batch, gen, 2, torch.device("cpu"))
    assert a[0] == _seed_for(7, 4) and b[0] == _seed_for(7, 6)
    assert a[1] != b[1] and a[2] != b[2]  # unseeded, and greedy (whose key the kernel ignores)


def test_logprobs(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0][0] == tok


def test_bf16_logits_sample_like_their_float32_copy():
    """The model hands the sampler logits in its own dtype: greedy rows, seeded random rows and
    logprobs must come out as from the exact float32 copy."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 500, generator=g) * 4).to(torch.bfloat16)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins in both
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_k=20, seed=4),
              SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.7, top_p=0.9, seed=5, logprobs=2)]
    batch = SamplingBatch(params, [0] * 6)
    got = sample(logits, batch)
    want = sample(logits.float(), batch)
    assert got == want
    assert got[0][1] == 7
    greedy_only = SamplingBatch(params[:2], [0, 0])
    assert sample(logits[:2], greedy_only)[0] == logits[:2].float().argmax(-1).tolist()


def test_seed_keys_of_the_int64_range_differ():
    """Every int64 seed has a stream of its own: the generator key of (seed, position) is a
    non-negative int64, and the ends of the range no longer fold onto its start (the key used to be
    reduced modulo 2**63 - 1, so 0 and 2**63 - 1 drew the same tokens, as did -1 and 2**63 - 2)."""
    from engine.sampler import _seed_for

    pairs = [(0, 2**63 - 1), (-1, 2**63 - 2), (1, -2**63), (2, 3)]
    for pos in (0, 1, 127):
        for a, b in pairs:
            assert _seed_for(a, pos) != _seed_for(b, pos)
        keys = [_seed_for(s, pos) for s in (-2**63, -1, 0, 1, 2**63 - 1)]
        assert all(0 <= k < 2**63 for k in keys)
    assert _seed_for(5, 0) != _seed_for(5, 1)
