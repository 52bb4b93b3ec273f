"""LoRA adapters (engine/lora.py): PEFT checkpoints served beside the base model, any mix of
adapters and the base model in one step, each sequence's tokens equal to transformers' with that
adapter merged into the weights; prefix caching keeps each adapter's blocks apart; the adapters
split over tensor-parallel ranks and pipeline stages; checkpoints that do not fit say why."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.lora import LoraError
from serve import LLM, LoRARequest, SamplingParams
from tests.models import build_model, model_greedy

CPU = dict(dtype="float32", device="cpu")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73], [40, 41, 42, 43, 44, 45],
           list(range(3, 40)), [7, 300, 12, 9]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _shapes(cfg) -> dict[str, tuple[int, int]]:
    """PEFT target -> (out, in) of a transformers config's projection."""
    d = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    q, kv, h, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def save_adapter(out: Path, model_dir: Path, targets: tuple[str, ...], r: int, alpha: float, seed: int,
                 rslora: bool = False, layers: tuple[int, ...] | None = None, **config) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT starts B at zero; a trained one is not)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    shapes = _shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(cfg.num_hidden_layers):
        for t in targets:
            o, i = shapes[t]
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[f"{key}.lora_A.weight"] = 0.3 * torch.randn(r, i, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.3 * torch.randn(o, r, generator=g)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "use_rslora": rslora,
        "bias": "none", "task_type": "CAUSAL_LM", "modules_to_save": None, "use_dora": False, **config}))
    return out


def merged_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens with the adapter merged: W + scale B A."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        _merge(model, adapter)
    return model_greedy(model, prompts, n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = build_model("llama", root / "model")
    a = save_adapter(root / "a", model, ALL, r=4, alpha=8, seed=1)
    # fewer targets, another rank, rsLoRA, one layer only, a per-module alpha
    b = save_adapter(root / "b", model, ("q_proj", "v_proj", "down_proj"), r=2, alpha=4, seed=2, rslora=True,
                     layers=(1,), alpha_pattern={"down_proj": 1.0})
    want = {name: merged_greedy(model, path, PROMPTS, GREEDY.max_tokens)
            for name, path in (("base", None), ("a", a), ("b", b))}
    return model, {"a": str(a), "b": str(b)}, want


def test_adapters_and_the_base_model_in_one_step_equal_merged_weights(setup):
    model, adapters, want = setup
    assert want["a"] != want["base"] and want["b"] != want["base"] and want["a"] != want["b"]
    with LLM(str(model), lora_modules=adapters, **CPU) as llm:
        names = ["a", None, "b", "a"] * 3
        prompts = [PROMPTS[i % 4] for i in range(12)]
        outs = llm.generate(prompts, GREEDY, lora_request=[LoRARequest(n) if n else None for n in names])
        for i, (n, o) in enumerate(zip(names, outs)):
            assert o.token_ids == want[n or "base"][i % 4], (i, n)
        # the same prompts again: each adapter's prefix blocks are its own (a shared one would be wrong)
        for n in ("b", "a", None):
            outs = llm.generate(PROMPTS, GREEDY, lora_request=n)
            assert [o.token_ids for o in outs] == want[n or "base"], n
        assert llm.engine.core.scheduler.prefix_cache_hits > 0
        with pytest.raises(ValueError, match="'c' is not loaded"):
            llm.generate(PROMPTS[0], GREEDY, lora_request="c")
        with pytest.raises(ValueError, match="not loaded"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, lora=3))


def test_chunked_prompts_and_preemption_keep_each_adapter(setup):
    model, adapters, want = setup
    names = ["b", "a", None, "a"]
    with LLM(str(model), lora_modules=adapters, max_num_batched_tokens=16, num_kv_blocks=8, block_size=8,
             max_num_seqs=4, **CPU) as llm:
        outs = llm.generate(PROMPTS, GREEDY, lora_request=names)
        assert [o.token_ids for o in outs] == [want[n or "base"][i] for i, n in enumerate(names)]


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_adapters_across_ranks(setup, split):
    model, adapters, want = setup
    names = [None, "a", "b", "a"]
    with LLM(str(model), lora_modules=adapters, **split, **CPU) as llm:
        outs = llm.generate(PROMPTS, GREEDY, lora_request=names)
        assert [o.token_ids for o in outs] == [want[n or "base"][i] for i, n in enumerate(names)]


def test_adapters_load_on_first_use_as_vllm_loads_them(setup, tmp_path):
    """enable_lora: a LoRARequest's path loads the adapter into a free slot, or over the one least
    recently asked for; one loaded again by name later gets the tokens it gave before, and an
    adapter in a slot another had used never reads that one's cached prefix blocks."""
    model, adapters, want = setup
    c = save_adapter(tmp_path / "c", model, ("o_proj", "up_proj"), r=8, alpha=4, seed=7)
    want["c"] = merged_greedy(model, c, PROMPTS, GREEDY.max_tokens)
    with LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, **CPU) as llm:
        runner, loras = llm.engine.runner, llm.engine.core.loras

        def run(requests):
            outs = llm.generate(PROMPTS, GREEDY, lora_request=requests)
            names = requests if isinstance(requests, list) else [requests] * len(PROMPTS)
            for i, (r, o) in enumerate(zip(names, outs)):
                name = r if isinstance(r, str) or r is None else r.lora_name
                assert o.token_ids == want[name or "base"][i], (i, name)

        run(LoRARequest("a", 1, adapters["a"]))  # vLLM's example
        run([LoRARequest("b", 2, adapters["b"]), None, "b", "a"])
        assert runner.lora_slots == 2 and sorted(loras.loaded) == ["a", "b"]
        slot_a = loras.loaded["a"][1]
        run("b")  # a is now the least recently used
        run(LoRARequest("c", 3, str(c)))
        assert sorted(loras.loaded) == ["b", "c"] and loras.loaded["c"][1] == slot_a
        run(["a", None, "c", "a"])  # a again, by name, over b
        assert sorted(loras.loaded) == ["a", "c"]
        assert llm.engine.core.scheduler.prefix_cache_hits > 0
        with pytest.raises(ValueError, match="ask for 3 LoRA adapters; the engine holds 2"):
            llm.generate(PROMPTS[:3], GREEDY, lora_request=["a", "b", "c"])
        with pytest.raises(ValueError, match="'d' is not loaded; give its path"):
            llm.generate(PROMPTS[0], GREEDY, lora_request="d")
        wide = save_adapter(tmp_path / "wide", model, ("q_proj",), r=16, alpha=2, seed=3)
        with pytest.raises(LoraError, match="rank 16; the adapter slots hold up to 8"):
            llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("w", 4, str(wide)))
        run(["c", "a", None, "c"])  # a failed load leaves the loaded ones as they were


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_adapters_load_on_every_rank(setup, split):
    model, adapters, want = setup
    with LLM(str(model), enable_lora=True, max_loras=1, max_lora_rank=4, **split, **CPU) as llm:
        for name in ("a", "b", "a"):
            outs = llm.generate(PROMPTS, GREEDY, lora_request=[LoRARequest(name, 0, adapters[name]), None] * 2)
            assert [o.token_ids for o in outs] == [want[name][0], want["base"][1], want[name][2], want["base"][3]]


def test_checkpoints_that_do_not_fit(setup, tmp_path):
    model, adapters, _ = setup
    other = build_model("llama", tmp_path / "wide", hidden_size=96)
    wide = save_adapter(tmp_path / "wide-a", other, ("q_proj",), r=2, alpha=2, seed=3)
    with pytest.raises(LoraError, match="another model"):
        LLM(str(model), lora_modules={"w": str(wide)}, **CPU)
    with pytest.raises(LoraError, match="no adapter_config.json"):
        LLM(str(model), lora_modules={"x": str(tmp_path)}, **CPU)
    dora = save_adapter(tmp_path / "dora", model, ("q_proj",), r=2, alpha=2, seed=3, use_dora=True)
    with pytest.raises(LoraError, match="use_dora"):
        LLM(str(model), lora_modules={"d": str(dora)}, **CPU)
    with pytest.raises(ValueError, match="two LoRA adapters are named"):
        LLM(str(model), lora_modules=[("a", adapters["a"]), ("a", adapters["b"])], **CPU)
    with pytest.raises(LoraError, match="more than max_lora_rank 2"):
        LLM(str(model), lora_modules=adapters, max_lora_rank=2, **CPU)


@pytest.mark.gpu
def test_on_the_gpu(setup):
    """On a GPU, through the decode graphs (multi-step rounds), the piecewise and whole-step graphs
    (a 48-token budget chunks the prompts beside decodes) and async scheduling: float32 tokens
    equal eager steps' and transformers' with each adapter merged. (In bfloat16 the adapters' part is
    rounded apart from the weights: no merged reference to hold it to.)"""
    from tests.engine.test_gpu import compare

    model, adapters, _ = setup
    names = ["a", None, "b", "a", "b", None, None, "a"]
    prompts = [PROMPTS[i % 4] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    # (dtype, graphs: none, whole-step graphs for mixed steps, piecewise ones only)
    for dtype, graphs in (("float32", "none"), ("float32", "step"), ("float32", "piecewise")):
        with LLM(str(model), device="cuda", dtype=dtype, enforce_eager=graphs == "none", num_kv_blocks=256,
                 max_num_batched_tokens=48, lora_modules=adapters,
                 step_graph_max_tokens=0 if graphs == "piecewise" else 2304) as llm:
            runs[dtype, graphs] = [o.token_ids for o in llm.generate(prompts, params, lora_request=names)]
            # no sequence on an adapter: the decode graphs captured without them
            runs[dtype, graphs, "base"] = [o.token_ids for o in llm.generate(prompts, params)]
            runner = llm.engine.runner
            assert (runner.graphs is None) == (graphs == "none")
            assert runner.graphs is None or len(runner.graphs.plain) == len(runner.graphs.graphs)
            if graphs == "step":
                assert runner.steps is not None and runner.steps.num_runs > 0
            if graphs == "piecewise":
                assert runner.steps is None and runner.piecewise.num_runs > 0
    assert runs["float32", "step"] == runs["float32", "none"] == runs["float32", "piecewise"]
    assert runs["float32", "step", "base"] == runs["float32", "none", "base"] == runs["float32", "piecewise", "base"]
    import transformers

    for name in (None, "a", "b"):
        rows = [i for i, n in enumerate(names) if n == name]
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
        if name is not None:
            _merge(hf, Path(adapters[name]))
        want = [_greedy(hf, prompts[i], 16) for i in rows]
        compare(want, [runs["float32", "step"][i] for i in rows], hf, [prompts[i] for i in rows], f"lora {name}")
        if name is None:
            compare([_greedy(hf, p, 16) for p in prompts], runs["float32", "step", "base"], hf, prompts, "no adapter")


def _merge(model, adapter: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith("lora_A.weight"):
                b = tensors[key.replace("lora_A", "lora_B")]
                alpha = config["lora_alpha"]
                for pattern, v in (config.get("alpha_pattern") or {}).items():
                    if key.split(".lora_A")[0].endswith(pattern):
                        alpha = v
                scale = alpha / (math.sqrt(a.shape[0]) if config.get("use_rslora") else a.shape[0])
                w = model.get_submodule(key[len("base_model.model."):-len(".lora_A.weight")]).weight
                w += (scale * b.float() @ a.float()).to(w.device, w.dtype)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_the_calculator_counts_what_the_adapters_take(setup, tmp_path):
    """kv-calc's LoraShape (from the adapters' configs alone) gives the bytes engine/lora.py
    allocates, on one rank and on each of two, and the KV cache shrinks by them."""
    from engine.config import ModelConfig
    from engine.lora import attach, load_adapter
    from engine.models.llama import LlamaForCausalLM
    from engine.parallel.comm import Comm
    from kvcache.calc import plan
    from serve.lora import lora_shape

    model, adapters, _ = setup
    cfg = ModelConfig.from_path(model)
    shape = lora_shape(list(adapters.values()))
    assert (shape.slots, shape.rank) == (2, 4) and shape.targets == frozenset(ALL)
    loaded = [load_adapter(n, p, cfg) for n, p in adapters.items()]
    for tp in (1, 2):
        allocated = 0
        for rank in range(tp):
            comm = Comm()
            comm.rank, comm.size = rank, tp
            with torch.device("meta"):
                m = LlamaForCausalLM(cfg, comm)
            m = m.to_empty(device="cpu")
            masks = attach(m, len(loaded), max(a.rank for a in loaded), frozenset(ALL), 16, torch.device("cpu"),
                           torch.float32)
            allocated = sum(x.weights.a.numel() + x.weights.b.numel() for x in masks.modules) * 4
            assert allocated == shape.bytes_per_layer(cfg, "float32", tp) * cfg.num_layers
    base = plan(cfg, 1 << 30, dtype="float32")
    with_lora = plan(cfg, 1 << 30, dtype="float32", lora=shape)
    assert with_lora.weight_bytes - base.weight_bytes == shape.bytes_per_layer(cfg, "float32") * cfg.num_layers
    assert with_lora.kv_cache_bytes < base.kv_cache_bytes
    # a regex target and all-linear read as PEFT reads them
    regex = save_adapter(tmp_path / "re", model, ("q_proj", "v_proj"), r=2, alpha=2, seed=1,
                         target_modules=r".*\.(q_proj|v_proj)", rank_pattern={"v_proj": 6})
    assert lora_shape([str(regex)]).targets == {"q_proj", "v_proj"} and lora_shape([str(regex)]).rank == 6


@pytest.mark.gpu
def test_loading_on_the_gpu(setup):
    """Adapters loaded into a slot after start-up, under the CUDA graphs captured before (the
    slots keep their addresses): float32 tokens equal transformers' with each adapter merged."""
    import transformers

    from tests.engine.test_gpu import compare

    model, adapters, _ = setup
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS * 2
    with LLM(str(model), device="cuda", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48,
             enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        for name in ("a", "b", "a"):
            got = [o.token_ids for o in llm.generate(prompts, params, lora_request=LoRARequest(name, 0, adapters[name]))]
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
            _merge(hf, Path(adapters[name]))
            compare([_greedy(hf, p, 16) for p in prompts], got, hf, prompts, f"loaded {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus(setup):
    """Tensor parallel over two GPUs in float32 (the fused all-reduce, the graphs): an adapter
    loaded at start-up, one loaded on first use and the base model in the same steps, then the base
    model alone (the decode graphs without adapters) equal transformers with each merged."""
    import transformers

    from tests.engine.test_gpu import compare

    model, adapters, _ = setup
    names = ["a", None, "b", "a", "b", None, None, "a"]
    prompts = [PROMPTS[i % 4] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(model), dtype="float32", tensor_parallel_size=2, num_kv_blocks=256, max_num_batched_tokens=48,
             lora_modules={"a": adapters["a"]}, enable_lora=True, max_loras=2, max_lora_rank=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params,
                                                 lora_request=[n and LoRARequest(n, 0, adapters[n]) for n in names])]
        base = [o.token_ids for o in llm.generate(prompts, params)]
    for name in (None, "a", "b"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
        if name is not None:
            _merge(hf, Path(adapters[name]))
        rows = [i for i, n in enumerate(names) if n == name]
        compare([_greedy(hf, prompts[i], 16) for i in rows], [got[i] for i in rows], hf, [prompts[i] for i in rows],
                f"two GPUs, {name}")
        if name is None:
            compare([_greedy(hf, p, 16) for p in prompts], base, hf, prompts, "two GPUs, no adapter")
