"""LLM(pipeline_parallel_size=2), and x tensor_parallel_size=2: ranks with gloo on the CPU give
transformers' greedy output in float32 (roomy, and with chunked prefill and preemption) with two
micro-batches in flight; each stage holds only its layers' weights and KV; dummy weights give the
one-GPU model, also over three stages; sampled rows equal PP=1's; a size larger than the layers, or more ranks than GPUs, is
a ValueError; a stage rank killed mid-run fails every request and stops the engine."""
from __future__ import annotations

import json
from dataclasses import replace
import time

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.parallel.stage import stage_of
from kvcache.calc import stage_layer_ranges
from scheduler.request import Batch, ExecutorLost, ScheduledSeq, Sequence
from serve import LLM, SamplingParams
from tests.engine.test_async_scheduling import params_mix, prompts, summary
from tests.engine.test_equal_transformers import make_prompts
from tests.engine.test_tensor_parallel import kill_rank_mid_run, same_prompt_logprobs
from tests.models import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
CPU = dict(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def expected(tiny_models):
    ps = make_prompts(2)
    return ps, {arch: hf_greedy(tiny_models[arch], ps, MAX_NEW) for arch in ("llama", "qwen2", "qwen3")}


def check_done(llm):
    core = llm.engine.core
    assert not core.has_unfinished()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    core.scheduler.check_integrity()


@pytest.mark.parametrize("arch, setting", [("llama", "roomy"), ("llama", "chunked-preempt"), ("qwen2", "roomy"),
                                           ("qwen3", "chunked-preempt")])
def test_pp2_greedy_equals_transformers(tiny_models, expected, arch, setting):
    ps, want = expected
    # chunked-preempt: prompt chunks of up to 16 tokens; 8 blocks of 16 can't hold all six sequences
    kwargs = dict(num_kv_blocks=256) if setting == "roomy" else dict(num_kv_blocks=8, max_num_batched_tokens=16)
    with LLM(str(tiny_models[arch]), pipeline_parallel_size=2, **CPU, **kwargs) as llm:
        runner = llm.engine.runner
        assert len(runner.model.layers) == 1 and len(runner.pool.layers) == runner.kv_spec.num_layers == 1
        assert runner.model.norm is None and runner.model.lm_head is None  # stage 0: no head
        outs = llm.generate(ps, GREEDY)
        assert [o.token_ids for o in outs] == want[arch]
        core = llm.engine.core
        assert core.stats.max_in_flight == 2  # both stages had a micro-batch
        if setting == "chunked-preempt":
            assert core.stats.num_preemptions > 0
        check_done(llm)
        # a second round on the same ranks: mirrored sequences of the first were dropped, new ones arrive
        again = llm.generate(ps[:2], GREEDY)
        assert [o.token_ids for o in again] == want[arch][:2]


def test_tp2_pp2_greedy_equals_transformers(tiny_models, expected):
    ps, want = expected
    with LLM(str(tiny_models["llama"]), tensor_parallel_size=2, pipeline_parallel_size=2, num_kv_blocks=8,
             max_num_batched_tokens=16, **CPU) as llm:
        runner = llm.engine.runner
        assert runner.kv_spec.num_kv_heads == 1 and runner.kv_spec.num_layers == 1  # half the heads of half the layers
        outs = llm.generate(ps, GREEDY)
        assert [o.token_ids for o in outs] == want["llama"]
        assert llm.engine.core.stats.max_in_flight == 2
        assert llm.engine.core.stats.num_preemptions > 0
        check_done(llm)


def test_sampling_logprobs_and_stops_equal_pp1(tiny_models):
    """Seeded sampling, logprobs, EOS and length stops, chunked prefills next to decodes: PP=2's
    batch queue gives what one GPU's engine gives."""
    ps = prompts()
    kw = dict(max_num_batched_tokens=32, num_kv_blocks=24, **CPU)
    want = LLM(str(tiny_models["llama"]), **kw).generate(ps, params_mix())
    with LLM(str(tiny_models["llama"]), pipeline_parallel_size=2, **kw) as llm:
        got = llm.generate(ps, params_mix())
        check_done(llm)
    assert summary(got) == summary(want)


def test_prompt_logprobs_equal_pp1(tiny_models):
    """The last stage scores the prompt's rows of each chunk (a budget of 13 tokens leaves a chunk of
    one token), the earlier stages' hidden states carried to it."""
    ps = prompts()
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=k) for k in (2, 0, None)]
    params = (params * len(ps))[:len(ps)]
    kw = dict(max_num_batched_tokens=13, num_kv_blocks=24, **CPU)
    want = LLM(str(tiny_models["llama"]), **kw).generate(ps, params)
    with LLM(str(tiny_models["llama"]), pipeline_parallel_size=2, **kw) as llm:
        got = llm.generate(ps, params)
        check_done(llm)
    assert summary(got) == summary(want)
    assert all((o.prompt_logprobs is not None) == (p.prompt_logprobs is not None) for o, p in zip(got, params))
    same_prompt_logprobs(want, got)


def test_dummy_weights_equal_pp1_with_an_uneven_split(tmp_path, tiny_models):
    """One seeded random model whatever the stage count: 3 layers over 2 stages (2 + 1), tied and
    untied LM heads (the tied one is the embedding, on the other stage)."""
    prompts_ = [[5, 9, 300, 17], [380, 2, 77, 77, 41, 8, 8, 1, 99]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    for arch in ("llama", "qwen2"):
        cfg = json.loads((tiny_models[arch] / "config.json").read_text())
        cfg["num_hidden_layers"] = 3
        path = tmp_path / arch / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg))
        kwargs = dict(load_format="dummy", num_kv_blocks=32, seed=7, **CPU)
        one = LLM(str(path), **kwargs).generate(prompts_, params)
        with LLM(str(path), pipeline_parallel_size=2, **kwargs) as llm:
            assert len(llm.engine.runner.model.layers) == 2
            two = llm.generate(prompts_, params)
        assert [o.token_ids for o in two] == [o.token_ids for o in one]
        for a, b in zip(one, two):
            assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-5)


def test_three_stages_equal_one_process(tmp_path, tiny_models):
    """A stage between two others (it receives the carry and sends it on) and three micro-batches in
    flight: 4 layers over 3 stages (2 + 1 + 1), prompt chunks of 16 tokens and a cache too small for
    every sequence, against one process on the same seeded dummy weights."""
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    path = tmp_path / "llama4" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    ps = make_prompts(2)
    kwargs = dict(load_format="dummy", num_kv_blocks=8, max_num_batched_tokens=16, seed=7, **CPU)
    one = LLM(str(path), **kwargs).generate(ps, GREEDY)
    with LLM(str(path), pipeline_parallel_size=3, **kwargs) as llm:
        assert len(llm.engine.runner.model.layers) == 2
        three = llm.generate(ps, GREEDY)
        core = llm.engine.core
        assert core.stats.max_in_flight == 3 and core.stats.num_preemptions > 0
        check_done(llm)
    assert [o.token_ids for o in three] == [o.token_ids for o in one]


def test_stage_layers_split_evenly():
    assert stage_layer_ranges(2, 2) == [(0, 1), (1, 2)]
    assert stage_layer_ranges(5, 3) == [(0, 2), (2, 4), (4, 5)]
    for layers in (7, 32, 80, 81):
        for stages in (1, 2, 3, 4, 7):
            ranges = stage_layer_ranges(layers, stages)
            sizes = [e - s for s, e in ranges]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers and max(sizes) - min(sizes) <= 1
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    s = stage_of(80, 1, 3)
    assert (s.start, s.end, s.first, s.last) == (27, 54, False, False)


def test_a_stage_loads_only_its_tensors(tiny_models):
    """The last stage of a tied model: its layer, the final norm and the embedding as its LM head."""
    from engine.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_path(tiny_models["llama"])
    with torch.device("meta"):
        last = LlamaForCausalLM(cfg, stage=stage_of(cfg.num_layers, 1, 2))
        first = LlamaForCausalLM(cfg, stage=stage_of(cfg.num_layers, 0, 2))
    wmap = last.hf_weight_map()
    assert wmap["model.embed_tokens.weight"] == ("lm_head.weight", 0)
    assert "model.layers.1.mlp.down_proj.weight" in wmap and wmap["model.layers.1.mlp.down_proj.weight"][0].startswith("layers.0.")
    assert not any(k.startswith("model.layers.0.") for k in wmap)
    assert last.held_elsewhere("model.layers.0.mlp.down_proj.weight") and not last.held_elsewhere("model.norm.weight")
    assert first.held_elsewhere("model.norm.weight") and not first.held_elsewhere("model.embed_tokens.weight")
    n_first = sum(p.numel() for p in first.parameters())
    n_last = sum(p.numel() for p in last.parameters())
    assert n_first + n_last == cfg.num_params() + cfg.vocab_size * cfg.hidden_size  # the tied head twice


def test_sizes_that_do_not_fit_are_value_errors(tiny_models, monkeypatch):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than the model's 2 layers; use at most 2"):
        LLM(str(tiny_models["llama"]), pipeline_parallel_size=3, **CPU)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        LLM(str(tiny_models["llama"]), pipeline_parallel_size=0, **CPU)
    assert time.monotonic() - t0 < 5  # refused before any rank starts
    from engine.parallel.executor import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 x pipeline_parallel_size 2 needs 4 GPUs; 2 are visible"):
        check_devices(EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2), "cuda")
    check_devices(EngineConfig(pipeline_parallel_size=2), "cuda")


def test_a_stage_rank_killed_mid_run_fails_every_request_and_stops_the_engine(tiny_models):
    llm = LLM(str(tiny_models["llama"]), pipeline_parallel_size=2, num_kv_blocks=64, **CPU)
    try:
        def in_flight(core) -> None:  # a micro-batch is on its way through the stages when rank 1 dies
            assert len(core._in_flight) == 1

        outs = kill_rank_mid_run(llm, in_flight)  # rank 1: the last stage
        assert all("pipeline-parallel rank 1 (stage 1) exited (killed by signal SIGKILL)" in o.error for o in outs)
        core = llm.engine.core
        assert not core.has_unfinished() and core.lost is not None
        with pytest.raises(ExecutorLost, match="rank 1 .* exited"):
            core.add_request([1, 2, 3], GREEDY)
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < 10


def _stage(runner, folder, rank: int, kv_before: torch.Tensor) -> tuple:
    """Stage `rank` of 2 of the runner's model (a layer each: the tiny models have two), its weights
    loaded from folder, and a pool that holds this stage's layer of kv_before (the whole pool)."""
    from engine.loader import load_weights
    from engine.models.llama import LlamaForCausalLM, rope_cos_sin
    from kvcache.pool import KVPool

    cfg = runner.model_cfg
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, stage=stage_of(cfg.num_layers, rank, 2))
    model = model.to_empty(device="cpu")
    load_weights(model, folder, show_progress=False)
    model.cos_sin = rope_cos_sin(cfg, runner.max_model_len, "cpu")
    pool = KVPool(replace(runner.kv_spec, num_layers=1), runner.num_blocks, runner.device, runner.dtype)
    pool.kv.copy_(kv_before[rank:rank + 1])
    return model, pool


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.inference_mode()
def test_stage_pieces_compute_the_forward(tiny_models, arch):
    """The piecewise graphs of two stages (each "graph" run directly, as tests/engine/test_piecewise.py
    does): stage 0's pieces leave the carry, stage 1's start from it, and together they give the
    whole model's logits and KV."""
    from tests.engine.test_piecewise import _batch, _direct_pieces

    runner = LLM(str(tiny_models[arch]), num_kv_blocks=16, **CPU).engine.runner
    torch.manual_seed(0)
    runner.pool.kv.copy_(torch.randn_like(runner.pool.kv))
    batch = _batch(runner.kv_spec.block_size)
    input_ids, positions, meta, logit_idx, _, _ = runner.prepare(batch)
    kv_before = runner.pool.kv.clone()
    want = runner.model(runner.ops, input_ids, positions, runner.pool.layers, meta, logit_idx)

    cfg = runner.model_cfg
    carry, got = None, None
    for rank in range(2):
        model, pool = _stage(runner, tiny_models[arch], rank, kv_before)
        stage_runner = type("R", (), dict(model=model, ops=runner.ops, pool=pool, device=runner.device))
        pw = _direct_pieces(stage_runner, 64)
        out = pw.run(input_ids, positions, meta, logit_idx, carry)
        if rank == 0:
            assert out.shape == (2, batch.num_tokens, cfg.hidden_size)
            carry = out
        else:
            got = out
        torch.testing.assert_close(pool.kv[0], runner.pool.kv[rank], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Direct:
    def __init__(self, fn) -> None:
        self.replay = fn


class _HostRing:
    """engine/upload.py's UploadRing without pinned memory or CUDA events (CPU)."""

    def __init__(self, nbytes: int, slots: int = 2) -> None:
        self.nbytes = nbytes
        self._host = torch.zeros(nbytes, dtype=torch.uint8)

    def buffer(self):
        return self._host.numpy()

    def send(self, dst: torch.Tensor, nbytes: int) -> None:
        dst[:nbytes].copy_(self._host[:nbytes])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_stage_decode_graphs_compute_the_forward(tiny_models, arch, monkeypatch):
    """Two stages' decode graphs (each "graph" a direct call of what it captures, the input unpacking
    in Triton's interpreter): stage 0 replays to its carry, stage 1 from it to the logits and greedy
    tokens of the whole model's decode step."""
    pytest.importorskip("triton")
    from engine import cuda_graph

    monkeypatch.setattr(cuda_graph, "UploadRing", _HostRing)
    runner = LLM(str(tiny_models[arch]), num_kv_blocks=16, max_num_seqs=8, **CPU).engine.runner
    torch.manual_seed(0)
    runner.pool.kv.copy_(torch.randn_like(runner.pool.kv))
    kv_before = runner.pool.kv.clone()
    p = SamplingParams(max_tokens=4, temperature=0)
    items = []
    for n_ctx, table in ((21, [0, 1]), (9, [2]), (33, [3, 4, 5])):
        seq = Sequence(2000 + len(items), list(range(3, 3 + n_ctx)), p)
        seq.block_table = table
        items.append(ScheduledSeq(seq, n_ctx - 1, 1))
    batch = Batch(items, num_decode=3)
    input_ids, positions, meta, logit_idx, _, _ = runner.prepare(batch)
    want = runner.model(runner.ops, input_ids, positions, runner.pool.layers, meta, logit_idx)

    cfg = runner.model_cfg
    carry = None
    for rank in range(2):
        model, pool = _stage(runner, tiny_models[arch], rank, kv_before)
        g = cuda_graph.DecodeGraphs(model, runner.ops, pool.layers, 8, runner.max_blocks_per_seq,
                                    runner.kv_spec.block_size, runner.device)
        assert (g.carry is None) == (rank == 0)
        for bs in g.buckets:
            g.logits[bs] = g._forward(bs).clone()
            g.graphs[bs] = _Direct(lambda bs=bs, g=g: g.logits[bs].copy_(g._forward(bs)))
        words = runner._graph_inputs(items, None, g.host_inputs())
        if rank == 0:
            carry = g.replay_carry(3, words).clone()
            assert carry.shape == (2, 3, cfg.hidden_size)
        else:
            g.carry[:, :3].copy_(carry)
            logits, tokens = g.replay(3, words)
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(tokens, want.argmax(-1))
        torch.testing.assert_close(pool.kv[0], runner.pool.kv[rank], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pp2_on_two_gpus_equals_one_gpu_float32(tiny_models):
    """NCCL send/recv between the stages, each replaying its decode and piecewise graphs: float32
    output equals one GPU's (and so transformers')."""
    ps = make_prompts(2)
    kw = dict(dtype="float32", num_kv_blocks=256, max_num_seqs=16)
    for arch in ("llama", "qwen2"):
        want = LLM(str(tiny_models[arch]), **kw).generate(ps, GREEDY)
        with LLM(str(tiny_models[arch]), pipeline_parallel_size=2, **kw) as llm:
            runner = llm.engine.runner
            assert runner.graphs is not None and runner.piecewise is not None and runner.steps is None
            got = llm.generate(ps, GREEDY)
            assert llm.engine.core.stats.max_in_flight == 2
            assert runner.graphs.carry is None  # stage 0 embeds
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
