"""Mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert): tiny random checkpoints
built by transformers give its greedy output in float32 (roomy, with preemption, with chunked
prefill), also over two gloo ranks with tensor parallelism (each expert's width split) and with
expert parallelism (whole experts split); dummy weights are one model whatever the split; configs
the engine can't serve say why."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, ModelConfigError
from serve import LLM, SamplingParams
from tests.engine.test_equal_transformers import check_greedy, make_prompts
from tests.models import build_model, hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
CPU = dict(dtype="float32", device="cpu")
ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {arch: build_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def expected(moe_models):
    prompts = make_prompts(1)
    return prompts, {arch: hf_greedy(path, prompts, MAX_NEW) for arch, path in moe_models.items()}


def test_config_reads_both_transformers_generations(moe_models):
    qwen = ModelConfig.from_path(moe_models["qwen3_moe"])
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 3, 32)
    assert qwen.norm_topk_prob and qwen.qk_norm and qwen.dense_layers == (1,)
    assert [qwen.is_moe_layer(i) for i in range(2)] == [True, False]
    mixtral = ModelConfig.from_path(moe_models["mixtral"])
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (4, 2, 48)
    # transformers 4 named Qwen3-MoE's expert count num_experts, 5 num_local_experts
    raw = json.loads((moe_models["qwen3_moe"] / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    raw["decoder_sparse_step"], raw["mlp_only_layers"] = 2, []
    old = ModelConfig.from_dict(raw)
    assert old.num_experts == 8 and old.dense_layers == (0,)
    # active parameters: the router whole, k of E experts
    h = qwen.hidden_size
    assert qwen.num_params() - qwen.active_params() == (8 - 3) * 3 * h * 32


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", ["roomy", "preempt", "chunked"])
def test_greedy_equals_transformers(moe_models, expected, arch, setting):
    prompts, want = expected
    kwargs = dict(num_kv_blocks=256)
    if setting == "preempt":
        kwargs.update(num_kv_blocks=8)  # 6 sequences of up to 62 tokens need 14 blocks of 16
    elif setting == "chunked":
        kwargs.update(max_num_batched_tokens=8, max_num_seqs=3)
    check_greedy(LLM(str(moe_models[arch]), **CPU, **kwargs), prompts, want[arch], setting, GREEDY)


def _llm(model: str, **kwargs) -> LLM:
    return LLM.from_config(EngineConfig(model=model, **CPU, **kwargs))


@pytest.mark.parametrize("arch, expert_parallel", [("qwen3_moe", False), ("mixtral", True), ("qwen2_moe", False),
                                                   ("qwen2_moe", True)])
def test_two_ranks_equal_transformers(moe_models, expected, arch, expert_parallel):
    """Chunked prefill and preemption over two gloo ranks: each expert's width split (tensor
    parallel), or half the experts on each rank (expert parallel)."""
    prompts, want = expected
    with _llm(str(moe_models[arch]), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              num_kv_blocks=8, max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want[arch]
        assert llm.engine.core.stats.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_one_gpu_equals_transformers(moe_models, expected, arch):
    """float32 on a GPU: the Triton MoE kernel (and Qwen2-MoE's shared expert) under the CUDA graphs."""
    prompts, want = expected
    with LLM(str(moe_models[arch]), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
             max_num_batched_tokens=32) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want[arch]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("arch, expert_parallel", [("mixtral", True), ("qwen3_moe", False)])
def test_two_gpus_equal_transformers(moe_models, expected, arch, expert_parallel):
    """On two GPUs in float32, where the MoE block's partial sums go into the all-reduce fused with
    the next norm (the first tensor-parallel engine of a process; a later one takes NCCL)."""
    prompts, want = expected
    with LLM(str(moe_models[arch]), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             num_kv_blocks=64, max_num_seqs=8) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want[arch]


def test_dummy_weights_are_one_model_whatever_the_split(moe_models):
    prompts = [[5, 9, 300, 17], [380, 2, 77, 77, 41, 8, 8, 1, 99]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    model = str(moe_models["qwen3_moe"] / "config.json")
    kwargs = dict(load_format="dummy", num_kv_blocks=32, seed=7)
    one = _llm(model, **kwargs).generate(prompts, params)
    with _llm(model, tensor_parallel_size=2, enable_expert_parallel=True, **kwargs) as llm:
        two = llm.generate(prompts, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        assert [lp.logprob for lp in b.logprobs] == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-5)


def loaded(folder):
    """(our model with the checkpoint's weights, on the CPU; the checkpoint's tensors by name)."""
    from safetensors.torch import load_file

    from engine.loader import load_weights
    from engine.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_path(folder))
    model = model.to_empty(device="cpu").float()
    load_weights(model, folder, show_progress=False)
    hf = {}
    for f in folder.glob("*.safetensors"):
        hf.update(load_file(str(f)))
    return model, hf


def test_loaded_experts_are_the_checkpoints(moe_models):
    """The stacked w13 [E, 2I, H] holds each expert's gate rows then up rows; w2 its down projection."""
    model, hf = loaded(moe_models["mixtral"])
    ex = model.layers[1].mlp.experts
    base = "model.layers.1.block_sparse_moe."
    assert torch.equal(ex.w13[2], torch.cat((hf[base + "experts.2.w1.weight"], hf[base + "experts.2.w3.weight"])))
    assert torch.equal(ex.w2[3], hf[base + "experts.3.w2.weight"])
    assert torch.equal(model.layers[1].mlp.gate.weight, hf[base + "gate.weight"])


def test_configs_the_engine_cannot_serve_say_why(moe_models, tiny_models):
    raw = json.loads((moe_models["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="with a shared expert .* is not supported"):
        ModelConfig.from_dict({**raw, "n_shared_experts": 2})
    assert ModelConfig.from_dict({**raw, "shared_expert_intermediate_size": 64}).shared_expert_size == 0  # Qwen3-MoE
    with pytest.raises(ModelConfigError, match="unsupported architecture DeepseekV2ForCausalLM"):
        ModelConfig.from_dict({**raw, "architectures": ["DeepseekV2ForCausalLM"]})
    six = ModelConfig.from_dict({**raw, "num_local_experts": 6})
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide the model's 6 experts; "
                                         "sizes that fit this model: 1, 2"):
        six.check_tensor_parallel(4, expert_parallel=True)
    six.check_tensor_parallel(4)  # the experts' width (32) splits
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide the model's 30 expert width"):
        ModelConfig.from_dict({**raw, "moe_intermediate_size": 30}).check_tensor_parallel(4)
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model; "
                                         "LlamaForCausalLM has no experts"):
        ModelConfig.from_path(tiny_models["llama"]).check_tensor_parallel(2, expert_parallel=True)


def test_shared_expert_parameters(moe_models):
    """Qwen2-MoE's shared expert and its gate: loaded as the checkpoint has them, and counted (kv-calc's
    weights) as transformers' model has them."""
    import transformers

    from engine.models.llama import LlamaForCausalLM

    folder = moe_models["qwen2_moe"]
    cfg = ModelConfig.from_path(folder)
    assert (cfg.shared_expert_size, cfg.norm_topk_prob, cfg.attention_bias) == (48, False, True)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert cfg.num_params() == sum(p.numel() for p in hf_model.parameters())
    model, hf = loaded(folder)
    mlp, base = model.layers[0].mlp, "model.layers.0.mlp."
    assert torch.equal(mlp.shared_expert.gate_up_proj.weight, torch.cat((hf[base + "shared_expert.gate_proj.weight"],
                                                                         hf[base + "shared_expert.up_proj.weight"])))
    assert torch.equal(mlp.shared_expert.down_proj.weight, hf[base + "shared_expert.down_proj.weight"])
    assert torch.equal(mlp.shared_expert_gate.weight, hf[base + "shared_expert_gate.weight"])
    from engine.parallel.comm import Comm
    from engine.parallel.group import TPGroup
    from kvcache.calc import tensor_parallel_problem, weight_bytes_per_gpu

    for expert_parallel in (False, True):  # what a rank holds is what kv-calc counts
        with torch.device("meta"):
            rank = LlamaForCausalLM(cfg, Comm(TPGroup(rank=1, size=2)), expert_parallel=expert_parallel)
        assert 4 * sum(p.numel() for p in rank.parameters()) == weight_bytes_per_gpu(cfg, "float32", 2)
    odd = dataclasses.replace(cfg, shared_expert_size=50)
    assert tensor_parallel_problem(odd, 4, expert_parallel=True).startswith("4 must divide the model's shared expert "
                                                                            "width 50; sizes that fit this model: 1, 2")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_triton_backend_equals_transformers(moe_models, expected, arch):
    """The engine's Triton op set (kernels/moe.py, and the dense MLP's for Qwen2-MoE's shared expert,
    interpreted on the CPU), chunked: mixed steps."""
    pytest.importorskip("triton")
    prompts, want = expected
    llm = LLM(str(moe_models[arch]), **CPU, num_kv_blocks=32, backend="triton", max_num_batched_tokens=16)
    outs = llm.generate(prompts[1:3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [w[:3] for w in want[arch][1:3]]


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_kv_calc_weights_are_the_models_parameters(preset):
    """kvcache/calc.py's weights per GPU equal the parameters a rank's model holds (on the meta
    device), with each expert's width split or whole experts split."""
    from engine.models.llama import LlamaForCausalLM
    from engine.parallel.comm import Comm
    from engine.parallel.group import TPGroup
    from engine.presets import resolve_model
    from kvcache.calc import weight_bytes_per_gpu

    cfg = resolve_model(preset).config
    for size, expert_parallel in ((1, False), (2, False), (2, True), (4, True)):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, Comm(TPGroup(rank=size - 1, size=size)), expert_parallel=expert_parallel)
        held = 2 * sum(p.numel() for p in model.parameters())
        assert held == weight_bytes_per_gpu(cfg, "bfloat16", size)
