"""Speculative decoding with a draft model (engine/draft.py): the draft model proposes k tokens a
sequence on the device and the model verifies them in one step. Its KV cache follows the model's
block tables and is caught up in drafting rounds; with the model itself as its draft (the same
weights) every draft must be kept, which only holds where that KV is right at every position
(prompts caught up in chunks, the k-th draft token's KV, preempted sequences and shared prefix
blocks written again). With another model as the draft, the tokens are those of the engine without
drafts, whatever it keeps: greedy, seeded sampling, rows without drafts beside drafted ones."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfigError
from serve import LLM, SamplingParams
from tests.engine.test_speculative import CPU, PROMPTS, generate, mixed_rows
from tests.models import build_model, hf_greedy


def spec(model, k: int = 4) -> dict:
    return {"model": str(model), "num_speculative_tokens": k}


def set_gate(llm: LLM, ratio: float | None) -> None:
    """What drafting costs a step, as the scheduler's gate sees it (SchedulerConfig.speculation_ratio);
    None: drafts in every step, whatever the GPU's cost model says they pay (the gate has its own test)."""
    import dataclasses

    sched = llm.engine.core.scheduler
    sched.config = dataclasses.replace(sched.config, speculation_ratio=None if ratio is None else lambda seqs: ratio)


def test_catch_up_chunks_follow_each_sequence_in_order():
    """The positions from a sequence's draft KV to its last token, in forwards of at most budget
    tokens; a block table replaced since (preemption) starts the sequence over."""
    from engine.draft import catch_up_chunks, draft_kv_done
    from scheduler.request import ScheduledSeq, Sequence

    a, b, c = (Sequence(i, list(range(30)), SamplingParams(max_tokens=5)) for i in range(3))
    for seq in (a, b, c):
        seq.block_table = [1, 2]
    a.draft_kv = (a.block_table, 20)
    b.draft_kv = ([7, 8], 25)  # written under a table b no longer has
    c.draft_kv = (c.block_table, 29)
    assert [draft_kv_done(s) for s in (a, b, c)] == [20, 0, 29]
    items = [ScheduledSeq(s, 29, 5, [-1] * 4) for s in (a, b, c)]
    chunks = catch_up_chunks(items, 16)
    assert [[(it.seq.seq_id, it.start, it.num_new_tokens) for it in f] for f in chunks] == [
        [(0, 20, 9), (1, 0, 7)], [(1, 7, 16)], [(1, 23, 6)]]
    assert catch_up_chunks(items[2:], 16) == []


@pytest.mark.parametrize("setting", ["roomy", "chunked-preempt", "async", "async-chunked-preempt"])
def test_greedy_equals_without_drafts(tiny_models, setting):
    """chunked: prompts and their draft catch-up in chunks of 16 tokens, sequences preempted (their
    draft KV starts over); async: a drafted row's last token may still be pending on the device."""
    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    kw = dict() if "chunked" not in setting else dict(num_kv_blocks=9, max_num_batched_tokens=16)
    kw["async_scheduling"] = setting.startswith("async")
    plain, base, _ = generate(model, params, **kw)
    assert [ids for ids, _ in plain] == hf_greedy(model, PROMPTS, 30)
    same, stats, _ = generate(model, params, speculative_config=spec(model), **kw)
    assert same == plain
    assert stats["drafted"] > 0 and stats["accepted"] == stats["drafted"] and stats["steps"] < base["steps"] / 2
    if "chunked" in setting:
        assert stats["preemptions"] > 0
    other, stats, _ = generate(model, params, speculative_config=spec(tiny_models["qwen2"], 3), **kw)
    assert other == plain and stats["drafted"] > 0


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_pages(tiny_models, kv):
    """The draft model's pool takes the model's KV dtype (and its 32-token pages)."""
    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain, _, _ = generate(model, params, kv_cache_dtype=kv)
    same, stats, _ = generate(model, params, kv_cache_dtype=kv, speculative_config=spec(model, 3))
    assert same == plain and stats["accepted"] == stats["drafted"] > 0


def test_seeded_sampling_equals_without_drafts(tiny_models):
    params = [SamplingParams(max_tokens=25, temperature=t, top_p=tp, seed=s, ignore_eos=True)
              for t, tp, s in ((0.3, 1.0, 1), (0.8, 0.9, 2), (0.2, 1.0, 3), (1.0, 1.0, 4), (0.1, 0.95, 5))]
    model = tiny_models["llama"]
    plain, _, _ = generate(model, params)
    same, stats, _ = generate(model, params, speculative_config=spec(model))
    assert same == plain and stats["accepted"] > 0
    other, _, _ = generate(model, params, speculative_config=spec(tiny_models["qwen3"]))
    assert other == plain


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rows_without_drafts_beside_rows_with(tiny_models, async_scheduling):
    """Logprobs, a grammar and penalties take no draft; a row near its max_tokens takes none either
    (fewer than k tokens are left) and its draft KV falls behind; stop tokens end drafted rows where
    they would end without drafts."""
    model = tiny_models["llama"]
    params, stop = mixed_rows(model)
    plain, _, _ = generate(model, params, async_scheduling=async_scheduling)
    same, stats, _ = generate(model, params, speculative_config=spec(model), async_scheduling=async_scheduling)
    assert same == plain and stats["accepted"] == stats["drafted"] > 0
    assert same[0][1] == "stop" and same[0][0][-1] == stop and len(same[4][0]) == 7


def test_drafts_stop_where_they_do_not_pay(tiny_models):
    """The scheduler takes drafts while the tokens a drafted sequence keeps a step make up for what
    drafting costs (SchedulerConfig.speculation_ratio, the GPU's cost model; 1.5 here): a draft model
    whose drafts are never kept stops after a few steps and then drafts in a probe step every
    PROBE_STEPS; the model as its own draft keeps drafting; at a cost nothing pays for (5: more than
    the k + 1 tokens a round can keep), it never drafts, its probes (5 - 1) / PROBE_SHARE steps apart."""
    from scheduler.policy import PROBE_SHARE, PROBE_STEPS

    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)

    def run(draft, ratio):
        with LLM(str(model), num_kv_blocks=64, speculative_config=spec(draft, 3), **CPU) as llm:
            sched = llm.engine.core.scheduler
            set_gate(llm, ratio)
            outs = [o.token_ids for o in llm.generate(PROMPTS, params)]
            return outs, sched.num_draft_tokens // 3 // len(PROMPTS), llm.engine.core.stats.num_steps, sched

    plain = generate(model, params)[0]
    outs, rounds, steps, sched = run(tiny_models["qwen2"], 1.5)
    assert outs == [ids for ids, _ in plain]
    assert sched.num_accepted_tokens < sched.num_draft_tokens / 10 and sched.kept_per_draft < 1.5
    # drafting until the average falls below 1.5 (4 -> 1.5 at ~0.76 of the way a step), then probes
    assert 2 <= rounds <= 2 + steps // PROBE_STEPS + 1 and steps > 70
    outs, rounds, steps, sched = run(model, 1.5)
    assert outs == [ids for ids, _ in plain] and sched.kept_per_draft == 4.0 and steps < 25
    outs, rounds, steps, sched = run(model, 5.0)
    assert outs == [ids for ids, _ in plain] and 70 < steps < 4 / PROBE_SHARE and rounds == 0


def test_shared_prefix_blocks_and_later_turns(tiny_models):
    """A prompt that finds its prefix in the cache (blocks another sequence wrote) catches its draft
    KV up from its start; a later request continues a finished one's text: every draft kept."""
    model = tiny_models["llama"]
    base = list(range(40, 90))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(str(model), num_kv_blocks=64, speculative_config=spec(model, 3), **CPU) as llm:
        first = llm.generate([base], params)[0].token_ids
        later = llm.generate([base + [7, 8, 9], base + first + [5]], params)
        core = llm.engine.core
        assert core.scheduler.prefix_cache_hits > 0
        assert core.scheduler.num_accepted_tokens == core.scheduler.num_draft_tokens > 0
    with LLM(str(model), num_kv_blocks=64, **CPU) as llm:
        want = [o.token_ids for o in llm.generate([base + [7, 8, 9], base + first + [5]], params)]
    assert [o.token_ids for o in later] == want


def test_bad_draft_models(tiny_models, tmp_path):
    model = tiny_models["llama"]
    with pytest.raises(ModelConfigError, match="speculative_config's draft model: model folder .* not found"):
        LLM(str(model), speculative_config=spec(tmp_path / "none"), **CPU)
    big = build_model("llama", tmp_path / "big", vocab_size=600)
    with pytest.raises(ModelConfigError, match="larger vocabulary"):
        LLM(str(model), speculative_config=spec(big), **CPU)
    with pytest.raises(ValueError, match="pipeline parallelism is not supported"):
        LLM(str(model), speculative_config=spec(model), pipeline_parallel_size=2, **CPU)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tensor_parallel_equals_one_process(tiny_models, async_scheduling):
    """Rank 0 holds the draft model and sends every rank its drafts before the verifying step."""
    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    kw = dict(async_scheduling=async_scheduling, num_kv_blocks=9, max_num_batched_tokens=16)
    one, single, _ = generate(model, params, speculative_config=spec(model), **kw)
    tp, stats, _ = generate(model, params, speculative_config=spec(model), tensor_parallel_size=2, **kw)
    assert tp == one and stats["accepted"] == stats["drafted"] > 0
    if not async_scheduling:
        assert stats == single
    other, _, _ = generate(model, params, speculative_config=spec(tiny_models["qwen3"]), tensor_parallel_size=2, **kw)
    assert other == one


def test_served_by_a_prefill_decode_pair(tiny_models):
    """The decode engine drafts with KV pages that the prefill engine sent: its draft model computes
    the prompt's draft KV itself. Completions equal one engine's without drafts."""
    import httpx

    from tests.serve.helpers import ServerThread, build
    from tests.serve.test_shutdown import start_server
    from tests.serve.test_tensor_parallel_server import stop

    model = tiny_models["llama"]
    bodies = [{"prompt": p, "max_tokens": 30, "temperature": 0, "ignore_eos": True} for p in PROMPTS[:3]]
    with ServerThread(build(model)) as srv:
        want = [srv.http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    proc, port = start_server(model, "--disaggregate", "1:1", "--speculative-config", json.dumps(spec(model)))
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        got = [httpx.post(url, json=b, timeout=60).json()["choices"][0]["text"] for b in bodies]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        code, out = stop(proc)
    assert code == 0, out
    assert got == want
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("pagedserve:spec_decode_num_"):
            name = line.split("{")[0]
            counts[name] = counts.get(name, 0.0) + float(line.split()[-1])
    drafted = counts["pagedserve:spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and counts["pagedserve:spec_decode_num_accepted_tokens_total"] == drafted


@pytest.mark.gpu
def test_on_the_gpu(tiny_models):
    """On a GPU (float32, where the graphs' tokens equal eager ones): the draft model's rounds replayed
    from its decode graphs (k + 1 steps), verifying steps through the whole-step graphs (few rows) and
    the piecewise ones (more than 16 drafted rows), seeded rows on the Triton sampler: the tokens of
    an engine without drafts, and with the model as its own draft every greedy row's draft kept."""
    model = tiny_models["llama"]
    prompts = PROMPTS * 4
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    params = [greedy, SamplingParams(max_tokens=30, temperature=0.2, seed=7, ignore_eos=True)] * 10
    runs = []
    for draft in (None, model, tiny_models["qwen2"]):
        cfg = None if draft is None else spec(draft)
        with LLM(str(model), device="cuda", dtype="float32", num_kv_blocks=256, speculative_config=cfg) as llm:
            sched, runner = llm.engine.core.scheduler, llm.engine.runner
            if draft is not None:
                assert sched.config.speculation_ratio is not None and sched.config.speculation_ratio(4) > 1
                set_gate(llm, None)
            runs.append([o.token_ids for o in llm.generate(prompts, [greedy] * len(prompts))])
            if draft is model:
                assert sched.num_accepted_tokens == sched.num_draft_tokens > 0
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            runs.append([o.token_ids for o in llm.generate(prompts[:3], params[:3])])
            if draft is not None:
                assert runner.draft.graphs is not None and sched.num_draft_tokens > 0
                assert runner.steps is None or runner.steps.num_runs > 0
    assert runs[3:6] == runs[:3] and runs[6:] == runs[:3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_on_two_gpus(tiny_models):
    """Two ranks over NCCL: rank 0's draft model replays its graphs and broadcasts the drafts; the
    tokens equal one GPU's, every greedy draft kept with the model as its own draft (float32)."""
    model = tiny_models["llama"]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        with LLM(str(model), device="cuda", dtype="float32", num_kv_blocks=256, speculative_config=spec(model),
                 tensor_parallel_size=tp) as llm:
            set_gate(llm, None)
            runs.append([o.token_ids for o in llm.generate(PROMPTS * 4, params)])
            sched = llm.engine.core.scheduler
            assert sched.num_accepted_tokens == sched.num_draft_tokens > 0
    assert runs[1] == runs[0]
