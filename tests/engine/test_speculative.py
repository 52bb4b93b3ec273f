"""Speculative decoding with n-gram drafts (scheduler/ngram.py): the proposer finds the tokens that
followed the longest recent n-gram; an engine with it gives the tokens of one without it (greedy,
and seeded sampling, whose tokens are drawn per output position) and transformers', in fewer
steps where the output repeats, beside chunked prompts, preemption, rows it leaves without drafts
(logprobs, grammars, penalties), stops and max_tokens, and across tensor-parallel ranks and
pipeline stages."""
from __future__ import annotations

import pytest

from engine.grammar import regex_grammar
from scheduler.ngram import NgramProposer
from scheduler.request import SpeculativeConfig, SpeculativeConfigError
from serve import LLM, SamplingParams
from tests.models import hf_greedy

CPU = dict(dtype="float32", device="cpu")
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# prompts that repeat themselves, so that drafts exist from the first decode on
PROMPTS = [[5, 9, 11, 13, 5, 9, 11, 13, 5, 9, 11], [40, 41, 42, 43, 44, 45, 40, 41, 42], [7] * 12,
           list(range(3, 30)) + list(range(3, 12)), [300, 301, 302, 303, 304] * 6]


def test_proposer_takes_the_longest_recent_ngram():
    p = NgramProposer(3, 2, 3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at the start: 4, 9, 2 followed it
    assert p.propose(0, tokens, 8) == [4, 9, 2]
    assert p.propose(0, tokens, 2) == [4, 9]
    tokens += [7, 2, 3]  # (7, 2, 3) is new; the 2-gram (2, 3) last ended 1, 2, 3, and 7, 2, 3 followed
    assert p.propose(0, tokens, 8) == [7, 2, 3]
    tokens.append(99)
    assert p.propose(0, tokens, 8) == []  # (3, 99) never occurred
    assert p.propose(1, [1, 2], 4) == []  # too short
    assert p.propose(0, tokens, 0) == []
    # an index extended as the list grows (the scheduler's token list, appended to) equals one built at once
    grown, growing = NgramProposer(3, 2, 3), []
    for t in tokens:
        growing.append(t)
        assert grown.propose(5, growing, 8) == NgramProposer(3, 2, 3).propose(5, list(growing), 8)
    assert grown._index[5].upto == len(tokens) - 1
    p.drop(0)
    assert 0 not in p._index
    # a repeat: what followed the last occurrence runs into the tokens being predicted, and goes on
    assert NgramProposer(6, 2, 3).propose(2, [8, 1, 2, 3, 1, 2, 3], 6) == [1, 2, 3, 1, 2, 3]
    assert NgramProposer(4, 2, 3).propose(3, [9, 5, 5, 5], 8) == [5, 5, 5, 5]


def test_an_index_built_in_bulk_equals_one_built_token_by_token():
    """A prompt's index at its first draft is built n by n in C (past BULK new positions); it must
    propose what the position-by-position index does, and what a plain search finds."""
    import random

    from scheduler.ngram import BULK

    def search(tokens: list[int], limit: int) -> list[int]:
        for n in range(min(4, len(tokens) - 1), 1, -1):
            tail = tokens[-n:]
            for at in range(len(tokens) - 1 - n, -1, -1):  # the most recent earlier occurrence
                if tokens[at:at + n] == tail:
                    out = []
                    for src in range(at + n, at + n + limit):
                        out.append(tokens[src] if src < len(tokens) else out[src - len(tokens)])
                    return out
        return []

    rng = random.Random(5)
    tokens = [rng.randrange(12) for _ in range(40 * BULK)]  # a small vocabulary: many repeats
    grown, growing = NgramProposer(5, 2, 4), []
    for i, t in enumerate(tokens):
        growing.append(t)
        if i % 37 == 0 or i > len(tokens) - 50:
            whole = list(growing)
            want = search(whole, 5)
            assert NgramProposer(5, 2, 4).propose(1, whole, 5) == want  # in bulk, from scratch
            assert grown.propose(1, growing, 5) == want  # extended as the list grows


def test_kept_tokens_stop_at_the_first_disagreement():
    from engine.runner import accepted

    assert accepted([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept, then the next sample
    assert accepted([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # the second differs: its sample replaces it
    assert accepted([8, 5, 6, 7], [4, 5, 6]) == [8]


def test_config_checks():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3})
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 3, 2)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 1}).prompt_lookup_min == 1
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 6}).prompt_lookup_max == 6
    for bad, words in (({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
                       ({"method": "ngram"}, "needs num_speculative_tokens"),
                       ({"num_speculative_tokens": 0}, "from 1 to 16"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown key 'model'"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
                       ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "unknown key 'prompt_lookup_max'"),
                       ({"model": "", "num_speculative_tokens": 2}, "needs \"model\""),
                       ({"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "must be 1"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": "2"}, "prompt_lookup_min must be an integer"),
                       ("ngram", "JSON object")):
        with pytest.raises(SpeculativeConfigError, match=words):
            SpeculativeConfig.from_dict(bad)
    c = SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m", 3)
    assert SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}) == c
    with pytest.raises(ValueError, match="takes the place of multi-step rounds"):
        LLM(None, speculative_config=SPEC, num_scheduler_steps=4, **CPU)


def generate(model, params, prompts=PROMPTS, **kw):
    with LLM(str(model), num_kv_blocks=kw.pop("num_kv_blocks", 64), **CPU, **kw) as llm:
        outs = llm.generate(prompts, params)
        core = llm.engine.core
        sched = core.scheduler
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
        sched.check_integrity()
        stats = dict(steps=core.stats.num_steps, drafted=sched.num_draft_tokens, accepted=sched.num_accepted_tokens,
                     preemptions=core.stats.num_preemptions)
    return [(o.token_ids, o.finish_reason) for o in outs], stats, outs


@pytest.mark.parametrize("setting", ["roomy", "chunked-preempt", "async", "async-chunked-preempt"])
def test_greedy_equals_without_drafts_and_transformers(tiny_models, setting):
    """async: a step is scheduled while the one before runs (as on a GPU), so a draft may follow a
    pending token (the lookup's first token stands in for it); a step with drafts runs alone."""
    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    kw = dict() if "chunked" not in setting else dict(num_kv_blocks=9, max_num_batched_tokens=16)
    kw["async_scheduling"] = setting.startswith("async")
    plain, base, _ = generate(model, params, **kw)
    spec, stats, _ = generate(model, params, speculative_config=SPEC, **kw)
    assert spec == plain
    assert [ids for ids, _ in spec] == hf_greedy(model, PROMPTS, 30)
    assert stats["accepted"] > 0 and stats["steps"] < base["steps"]
    if "chunked" in setting:
        assert stats["preemptions"] > 0


def test_seeded_sampling_equals_without_drafts(tiny_models):
    """A seeded row draws each output position's token from that position's own noise: with a draft,
    the kept tokens are the ones it would have drawn without."""
    params = [SamplingParams(max_tokens=25, temperature=t, top_p=tp, seed=s, ignore_eos=True)
              for t, tp, s in ((0.3, 1.0, 1), (0.8, 0.9, 2), (0.2, 1.0, 3), (1.0, 1.0, 4), (0.1, 0.95, 5))]
    plain, _, _ = generate(tiny_models["llama"], params)
    spec, stats, _ = generate(tiny_models["llama"], params, speculative_config=SPEC)
    assert spec == plain and stats["accepted"] > 0


def mixed_rows(model) -> tuple[list[SamplingParams], int]:
    """Rows that take no draft (logprobs, a grammar, penalties) beside rows that do, one of them with
    a stop token it samples (its 9th greedy token), one ending after 7 -> (params, the stop token)."""
    plain_out = generate(model, [SamplingParams(max_tokens=40, temperature=0)] * len(PROMPTS))[0]
    stop = plain_out[0][0][8]
    return [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop]),
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=30, temperature=0, grammar=regex_grammar("[a-z ]{10,40}")),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)], stop


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rows_without_drafts_beside_rows_with(tiny_models, async_scheduling):
    """Logprobs, a grammar and penalties keep one token a step, in the same steps as drafted rows
    (async: the grammar's mask waits for its pending token in a step that verifies drafts); stop
    tokens and max_tokens end drafted rows where they would end without drafts."""
    model = tiny_models["llama"]
    params, stop = mixed_rows(model)
    plain, _, plain_outs = generate(model, params, async_scheduling=async_scheduling)
    spec, stats, spec_outs = generate(model, params, speculative_config=SPEC, async_scheduling=async_scheduling)
    assert spec == plain and stats["accepted"] > 0
    if async_scheduling:  # the followers get the grammar row's pending token before its mask
        assert generate(model, params, speculative_config=SPEC, async_scheduling=True, tensor_parallel_size=2)[0] == spec
    assert spec[0][1] == "stop" and spec[0][0][-1] == stop and len(spec[4][0]) == 7
    assert [lp.token_id for lp in spec_outs[1].logprobs] == spec[1][0]
    rounded = [[round(lp.logprob, 4) for lp in o.logprobs] for o in (spec_outs[1], plain_outs[1])]
    assert rounded[0] == rounded[1]


def test_tensor_parallel_and_pipeline_stages_equal_one_process(tiny_models):
    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    one, single, _ = generate(model, params, speculative_config=SPEC)
    assert single["accepted"] > 0
    tp, stats, _ = generate(model, params, speculative_config=SPEC, tensor_parallel_size=2)
    assert tp == one and stats == single
    tp, stats, _ = generate(model, params, speculative_config=SPEC, tensor_parallel_size=2, async_scheduling=True)
    assert tp == one and stats["accepted"] > 0
    pp, stats, _ = generate(model, params, speculative_config=SPEC, pipeline_parallel_size=2)
    assert pp == one and stats["accepted"] > 0


def test_served_with_metrics(tiny_models):
    """Over HTTP (an engine process, as `serve run` starts it): completions equal the engine's without
    drafts, and /metrics counts the draft tokens and those kept."""
    from tests.serve.helpers import ServerThread, build, build_process

    body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    with ServerThread(build(tiny_models["llama"])) as srv:
        want = srv.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with ServerThread(build_process(tiny_models["llama"], speculative_config=SPEC)) as srv:
        r = srv.http.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        text = srv.http.get("/metrics").text
    counts = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("pagedserve:spec_decode_num_")}
    drafted = counts["pagedserve:spec_decode_num_draft_tokens_total"]
    kept = counts["pagedserve:spec_decode_num_accepted_tokens_total"]
    drafts = counts["pagedserve:spec_decode_num_drafts_total"]
    assert 0 < kept <= drafted and 0 < drafts <= drafted <= 4 * drafts


@pytest.mark.parametrize("mode", [["--data-parallel-size", "2"], ["--disaggregate", "1:1"]])
def test_served_by_replicas_and_a_prefill_decode_pair(tiny_models, mode):
    """`serve run --speculative-config` with two replicas, and with a prefill and a decode engine (the
    decode engine drafts): completions, whole and streamed, equal one engine's without drafts."""
    import json

    import httpx

    from tests.serve.helpers import ServerThread, build
    from tests.serve.test_shutdown import start_server
    from tests.serve.test_tensor_parallel_server import stop

    bodies = [{"prompt": p, "max_tokens": 30, "temperature": 0, "ignore_eos": True} for p in PROMPTS[:3]]
    with ServerThread(build(tiny_models["llama"])) as srv:
        want = [srv.http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    proc, port = start_server(tiny_models["llama"], *mode, "--speculative-config", json.dumps(SPEC))
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        got = [httpx.post(url, json=b, timeout=60).json()["choices"][0]["text"] for b in bodies]
        streamed = ""
        with httpx.stream("POST", url, json={**bodies[0], "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        code, out = stop(proc)
    assert code == 0, out
    assert got == want and streamed == want[0]
    kept = [float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("pagedserve:spec_decode_num_accepted_tokens_total")]
    assert kept and sum(kept) > 0


@pytest.mark.gpu
def test_on_the_gpu(tiny_models):
    """On a GPU: verifying steps through the whole-step graphs (up to 16 drafted rows) and the
    piecewise ones (more), the Triton sampler for seeded rows: the tokens of an engine without drafts."""
    model = tiny_models["llama"]
    prompts = PROMPTS * 4  # 20 rows: more than a whole-step graph takes while all of them draft
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.2, seed=7, ignore_eos=True)] * 10
    runs = []
    for spec in (None, SPEC):
        with LLM(str(model), device="cuda", num_kv_blocks=256, speculative_config=spec) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            runs.append([o.token_ids for o in llm.generate(prompts[:3], params[:3])])  # few rows: whole-step graphs
            if spec is not None:
                assert llm.engine.core.scheduler.num_accepted_tokens > 0
                assert llm.engine.runner.steps is None or llm.engine.runner.steps.num_runs > 0
    assert runs[2:] == runs[:2]
