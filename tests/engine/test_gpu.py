"""On the GPU: the Triton path and CUDA graphs against transformers and the torch reference path."""
import json
import os
import random

import pytest
import torch

from serve import LLM, SamplingParams
from tests.models import VOCAB

pytestmark = pytest.mark.gpu
N = 16
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
TIE = 0.1  # logit gap below which two tokens count as a near-tie in bfloat16
REPORT = os.environ.get("PAGEDSERVE_GPU_REPORT")


def prompts(n=8, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(L)] for L in (1, 5, 16, 17, 31, 64, 100, 250)[:n]]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0, -1].float()


def compare(want, got, model, ps, label):
    """Token lists must be equal; a divergence is accepted only at a near-tie of the logits."""
    explained = []
    for p, w, g in zip(ps, want, got):
        if w == g:
            continue
        i = next(k for k in range(len(w)) if w[k] != g[k])
        logits = hf_logits(model, p + w[:i])
        gap = float(logits[w[i]] - logits[g[i]])
        explained.append(dict(prompt_len=len(p), position=i, gap=gap))
        assert abs(gap) <= TIE, f"{label}: divergence at token {i} of prompt {len(p)} with logit gap {gap:.3f}"
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(dict(test=label, prompts=len(ps), diverged=explained)) + "\n")
    return explained


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_bf16_triton_graphs_equal_transformers(tiny_models, arch):
    import transformers

    path = tiny_models[arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ps = prompts()
    want = []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p], device="cuda")
            want.append(hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                    do_sample=False)[0, len(p):].tolist())
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=512)
    assert llm.engine.runner.graphs is not None
    got = [o.token_ids for o in llm.generate(ps, GREEDY)]
    compare(want, got, hf, ps, f"bf16 triton+graphs vs transformers [{arch}]")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_triton_equals_torch_reference_path(tiny_models, dtype):
    import transformers

    path = tiny_models["llama"]
    ps = prompts()
    ref = [o.token_ids for o in LLM(str(path), dtype=dtype, backend="torch", enforce_eager=True,
                                    num_kv_blocks=512).generate(ps, GREEDY)]
    got = [o.token_ids for o in LLM(str(path), dtype=dtype, num_kv_blocks=512).generate(ps, GREEDY)]
    if dtype == "float32":
        assert got == ref
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
        compare(ref, got, hf, ps, "bf16 triton vs torch reference")


def test_graphs_equal_eager_at_odd_batch_sizes(tiny_models):
    path = tiny_models["qwen3"]
    for n in (1, 3, 5, 8):
        ps = prompts(n)
        eager = [o.token_ids for o in LLM(str(path), dtype="float32", enforce_eager=True, num_kv_blocks=256).generate(ps, GREEDY)]
        graph = [o.token_ids for o in LLM(str(path), dtype="float32", num_kv_blocks=256).generate(ps, GREEDY)]
        assert graph == eager, n


def test_padded_graph_slots_write_nowhere(tiny_models):
    import numpy as np

    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", num_kv_blocks=64, max_num_seqs=8)
    runner = llm.engine.runner
    g = runner.graphs
    assert g.bucket_for(3) == 4
    before = runner.pool.kv.clone()
    buf = g.host_inputs()  # the upload layout of kernels/graph_inputs.py: 3 rows, 6 table columns
    buf[:11] = [3, 6, 7, 8, 9, 5, 40, 77, -1, -1, -1]
    buf.view(np.int32)[22:22 + 18] = list(range(6)) * 3
    logits, tokens = g.replay(3, 11 + 9)
    torch.cuda.synchronize()
    assert logits.shape[0] == 3 and torch.equal(tokens, logits.argmax(-1))
    changed = (runner.pool.kv != before).any(-1).any(0).any(0).any(1)  # [blocks, block_size]
    written = changed.nonzero().tolist()
    assert sorted((b * 16 + o) for b, o in written) == [5, 40, 77]


def test_graph_steps_equal_eager_steps_with_sampling_and_logprobs(tiny_models):
    """Decode graphs sample greedy rows inside the graph and take pending input tokens from the
    previous step's samples on the device, whether that step was a graph or a mixed step: float32
    tokens and logprobs equal those of eager steps, with greedy, seeded and logprob rows and a
    small budget, so mixed steps and decode graphs alternate; and with rows whose logits are adjusted
    (engine/logit_adjust.py)."""
    ps = prompts()
    params = [SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=N, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=N - 3, temperature=0, ignore_eos=True),
              # adjusted logits: each sampled token counted on the device as it is sampled
              SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.4),
              SamplingParams(max_tokens=N, temperature=0.8, seed=5, min_p=0.1, logit_bias={9: 1.5}, ignore_eos=True,
                             frequency_penalty=0.3)] * 2
    params = params[:len(ps)]

    def run(eager):
        llm = LLM(str(tiny_models["qwen3"]), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48,
                  enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        outs = llm.generate(ps, params)
        greedy_only = llm.generate(ps[:5], GREEDY)  # every row greedy: tokens come from the graph itself
        return ([(o.token_ids, [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs or []]) for o in outs],
                [o.token_ids for o in greedy_only])

    assert run(False) == run(True)


def test_graph_memory_is_accounted_before_sizing_the_pool(tiny_models):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", max_num_seqs=256)
    runner = llm.engine.runner
    assert runner.num_blocks > 0 and runner.graphs is not None
    assert 0 < runner.graphs.pool_bytes <= runner.graph_bytes_reserved()
    pw = runner.piecewise
    assert pw is not None and pw.max_tokens == llm.config.max_num_batched_tokens
    steps = runner.steps
    assert steps is not None and steps.static_bytes > 0
    assert 0 < (pw.pool_bytes + pw.static_bytes + steps.pool_bytes + steps.static_bytes + runner.graphs.pool_bytes
                <= runner.graph_bytes_reserved())
    free, total = torch.cuda.mem_get_info()
    used = total - free
    assert used <= total * llm.config.gpu_memory_utilization + 256 * 2**20


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_async_scheduling_equals_sync_with_graphs(tiny_models, kv):
    """Overlapped steps (the GPU default) give the tokens and logprobs of waiting for each step,
    through decode graphs, mixed chunked steps and seeded sampling. (Stop tokens add a wasted row
    to the next overlapped step, hence another graph bucket and GEMM shapes: the CPU tests cover
    them, in float32.)"""
    ps = prompts()
    params = [SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=N, temperature=0.7, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=N - 5, temperature=0, ignore_eos=True)] * 2

    def run(async_scheduling):
        llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", kv_cache_dtype=kv, num_kv_blocks=256,
                  max_num_batched_tokens=96, async_scheduling=async_scheduling)
        assert llm.engine.runner.overlap == async_scheduling
        outs = llm.generate(ps, params)
        core = llm.engine.core
        assert not core.has_unfinished() and core.block_manager.num_free_blocks == core.block_manager.num_blocks
        return [(o.token_ids, o.finish_reason, [(lp.token_id, round(lp.logprob, 3)) for lp in o.logprobs or []])
                for o in outs]

    assert run(True) == run(False)


def test_multi_step_decode_equals_single_steps(tiny_models):
    """num_scheduler_steps 4: the same greedy tokens as one step per batch (the same graphs replayed
    on the same rows), with several steps per batch once only decodes run; a stop token inside such
    a batch drops what follows it; sampled rows sample every step of a round on the device, a
    seeded one as in single steps; no block leaks."""
    ps = prompts()

    def run(steps, params):
        llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", num_kv_blocks=256, max_num_batched_tokens=96,
                  num_scheduler_steps=steps)
        sched = llm.engine.core.scheduler
        seen, schedule = [], sched.schedule

        def spy(*a, **kw):
            b = schedule(*a, **kw)
            if b is not None:
                seen.append(b.num_steps)
            return b
        sched.schedule = spy
        outs = llm.generate(ps, params)
        core = llm.engine.core
        while core.has_unfinished():  # a stopped row's batch still in flight (async scheduling)
            assert not core.step()
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
        return [(o.token_ids, o.finish_reason) for o in outs], seen

    greedy = [SamplingParams(max_tokens=N + 3 * i, temperature=0, ignore_eos=True) for i in range(len(ps))]
    want, seen1 = run(1, greedy)
    got, seen4 = run(4, greedy)
    assert got == want and set(seen1) == {1} and 4 in seen4
    stop = [SamplingParams(max_tokens=N + 3 * i, temperature=0, ignore_eos=True, stop_token_ids=[w[6]])
            for i, (w, _) in enumerate(want)]
    want, _ = run(1, stop)
    got, seen4 = run(4, stop)
    assert got == want and 4 in seen4 and all(r == "stop" for _, r in got)
    # sampled rows run in the rounds too, each step sampled on the device: a seeded row draws the
    # tokens of single steps (its noise comes from its output position), an unseeded one its own
    mixed = greedy[:-3] + [SamplingParams(max_tokens=N, temperature=0.8, seed=1, ignore_eos=True),
                           SamplingParams(max_tokens=N, temperature=0.8, top_p=0.9, top_k=50, seed=2, ignore_eos=True),
                           SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True)]
    got, seen4 = run(4, mixed)
    want, _ = run(1, mixed)
    assert [t for t, _ in got[:-1]] == [t for t, _ in want[:-1]] and 4 in seen4
    assert len(got[-1][0]) == N


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_piecewise_graphs_equal_eager_steps(tiny_models, dtype, kv):
    """Steps with prefill tokens through the piecewise graphs (engine/piecewise.py) give the tokens
    of launching them eagerly. A 48-token budget chunks the prompts, so steps mix decodes with
    prefill chunks and run padded to the 16/32/48-token buckets."""
    import transformers

    path = tiny_models["qwen3"]
    ps = prompts()

    def run(piecewise):
        llm = LLM(str(path), dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=256, max_num_batched_tokens=48,
                  piecewise_graphs=piecewise, step_graph_max_tokens=0)
        pw = llm.engine.runner.piecewise
        assert (pw is not None) == piecewise
        out = [o.token_ids for o in llm.generate(ps, GREEDY)]
        if piecewise:
            # 16 or 32 may be left out where the cost model measured a larger forward no slower
            assert set(pw.buckets) <= {16, 32, 48} and pw.buckets[-1] == 48
            assert pw.num_runs >= sum(len(p) for p in ps) // 48
        return out

    eager, graphs = run(False), run(True)
    if dtype == "float32":
        assert graphs == eager
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
        compare(eager, graphs, hf, ps, f"piecewise graphs vs eager steps [{kv}]")


@pytest.mark.parametrize("budget", [48, 300])
@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_step_graphs_equal_eager_steps(tiny_models, dtype, kv, budget):
    """Steps with prefill tokens replayed from whole-step graphs (engine/step_graph.py: decode
    attention on a power-of-two row count, prefill attention over a work list) give the tokens and
    logprobs of eager steps. The budget chunks the prompts: 48 gives 16/32/48-token steps of
    decodes and a chunk or two; 300 a first step of several chunks (several work items each, no
    decodes) and later ones that mix up to 7 decodes with chunks."""
    import transformers

    path = tiny_models["qwen2"]
    ps = prompts()
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=2)

    def run(eager):
        llm = LLM(str(path), dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=256, max_num_batched_tokens=budget,
                  enforce_eager=eager)
        steps = llm.engine.runner.steps
        assert (steps is None) == eager
        outs = llm.generate(ps, params)
        if steps is not None:
            assert steps.num_runs >= 2 and (1, steps.token_buckets[-1]) in steps.graphs
        return [o.token_ids for o in outs], [[(lp.token_id, lp.logprob) for lp in o.logprobs] for o in outs]

    (eager, eager_lp), (graphs, graphs_lp) = run(True), run(False)
    if dtype == "float32":
        assert graphs == eager
        for a, b in zip(eager_lp, graphs_lp):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
        compare(eager, graphs, hf, ps, f"step graphs vs eager steps [{dtype}, {kv}, budget {budget}]")


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_pdl_equals_plain_launches(tiny_models, kv):
    """Programmatic dependent launch (kernels/pdl.py) changes when kernels start, not what they
    compute: the same tokens and logprobs through decode graphs and piecewise graphs of mixed
    steps (a 64-token budget chunks the prompts), and through eager steps."""
    ps = prompts()
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=2)

    def run(pdl, eager):
        llm = LLM(str(tiny_models["qwen2"]), dtype="bfloat16", kv_cache_dtype=kv, num_kv_blocks=256,
                  max_num_batched_tokens=64, pdl=pdl, enforce_eager=eager)
        assert llm.config.pdl == pdl
        outs = llm.generate(ps, params)
        return [(o.token_ids, [(lp.token_id, lp.logprob) for lp in o.logprobs]) for o in outs]

    assert run(True, False) == run(False, False)
    assert run(True, True) == run(False, True)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_serving_compiles_no_triton_kernel_after_startup(tiny_models, kv):
    """Every kernel variant a step can use is compiled while the engine starts (graph capture and
    warm-up), so no request mix stalls a step mid-serving on a compile. Prompts of many lengths
    under a small token budget give mixed steps with many decode counts, chunk lengths and cached
    prefixes. The in-memory kernel caches are emptied first: variants another test compiled in this
    process must not hide a miss (a compile from Triton's disk cache still counts)."""
    import sys

    from triton import knobs
    from triton.runtime.jit import JITFunction

    from kernels import launch

    for name, mod in list(sys.modules.items()):
        if name.startswith("kernels."):
            for fn in vars(mod).values():
                if isinstance(fn, JITFunction):
                    fn.device_caches.clear()
    launch._KERNELS.clear()
    llm = LLM(str(tiny_models["qwen3"]), kv_cache_dtype=kv, num_kv_blocks=512, max_num_batched_tokens=64)
    compiled = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        compiled.append(fn.name)
        return False

    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    ps = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 150))] for _ in range(30)]
    ps += [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(10)]
    # short ones: mixed steps with more than 64 decodes (decode attention's next launch plan)
    ps += [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))] for _ in range(60)]
    knobs.runtime.jit_cache_hook = hook
    try:
        llm.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        # sampled rows, and rows whose logits are adjusted first (float32 logits into the sampling kernel)
        mix = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, ignore_eos=True),
               SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, presence_penalty=0.5, min_p=0.05,
                              ignore_eos=True),
               SamplingParams(max_tokens=8, temperature=0, logit_bias={7: 2.0}, repetition_penalty=1.2,
                              ignore_eos=True),
               SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3, ignore_eos=True)]  # scored prompts
        llm.generate(ps[:40], [mix[i % 4] for i in range(40)])
    finally:
        knobs.runtime.jit_cache_hook = None
    assert compiled == []


def test_long_chunks_of_narrow_heads_compile_nothing_after_startup(tiny_models, tmp_path, monkeypatch):
    """64-wide heads take the Triton prefill kernel up to 2,304 tokens and the Hopper kernel past
    that (kernels/prefill_attention.py prefill_plan), so start-up must compile the Hopper kernel
    too: a first long prompt must not stall serving on a compile, nor a conversation's next turn.
    Dummy weights in a tiny model's shape with 64-wide heads, in bfloat16 (the Hopper kernel's), and
    a context long enough for such chunks."""
    import shutil

    from triton import knobs

    from kernels import prefill_attention

    folder = tmp_path / "narrow"
    shutil.copytree(tiny_models["qwen2"], folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               max_position_embeddings=4096)
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", num_kv_blocks=1024,
              max_num_batched_tokens=4096)
    compiled, plans = [], []
    plan = prefill_attention.prefill_plan

    def recording_plan(*args, **kwargs):
        cfg = plan(*args, **kwargs)
        plans.append((args[2], cfg["ws"]))  # max_query_len, ws
        return cfg

    monkeypatch.setattr(prefill_attention, "prefill_plan", recording_plan)

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        compiled.append(fn.name)
        return False

    rng = random.Random(7)
    lengths = (3000, prefill_attention.WS_NARROW_MIN_QUERY_LEN, 2400, 100, 1500, 2304)
    shared = [rng.randrange(3, VOCAB) for _ in range(2100)]
    first = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths] + [shared + [5] * 40]
    # then chunks of a few hundred tokens after the 2,096 cached ones (whole blocks)
    then = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (300, 90, 700)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    knobs.runtime.jit_cache_hook = hook
    try:
        outs = llm.generate(first, params) + llm.generate(then, params)
    finally:
        knobs.runtime.jit_cache_hook = None
    assert [len(o.token_ids) for o in outs] == [4] * (len(first) + len(then))
    assert any(ws for n, ws in plans if n >= prefill_attention.WS_NARROW_MIN_QUERY_LEN), plans
    assert compiled == []


def test_the_heater_fills_the_head_start():
    """The cost model's hot timing (engine/runner.py): the heater's matmuls stand in for the sleep
    kernel's head start, and the timed work still comes out of the events alone."""
    from engine.parallel.comm import Comm
    from engine.runner import _device_ms, _Heater

    heater = _Heater(torch.device("cuda"), Comm())
    assert heater.us_each >= 1
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    hot = _device_ms(lambda: a @ a, repeats=3, head=heater.run)
    # one product (~25 us); the head start is at least 1 ms of the heater's matmuls, outside the events
    assert 0 < hot < 1.0
