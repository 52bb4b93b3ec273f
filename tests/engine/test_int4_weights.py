"""4-bit weights (engine/quant.py Int4Format, engine/int4.py): AWQ, GPTQ and compressed-tensors
checkpoints, each written here in its own layout from the format's definition, compute what
transformers computes for the same model with the projections' weights dequantized; on one rank
and on two (gloo), and with dummy weights."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, ModelConfigError
from engine.int4 import AWQ_ORDER
from engine.quant import Int4Format, QuantizationError
from kernels import reference
from serve import LLM, SamplingParams
from tests.engine.test_equal_transformers import make_prompts
from tests.engine.test_fp8_weights import PROJ, _is_proj, check_greedy_near_best, check_prompt_logprobs, prompts_of
from tests.models import build_model, model_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _quantize(w: torch.Tensor, group: int, symmetric: bool):
    """w [N, K] -> (q uint8 [N, K] of 0-15, float16 scales and uint8 zero points [N, groups]):
    min/max levels, or symmetric around zero point 8."""
    N, K = w.shape
    g = K if group == -1 else group
    wf = w.reshape(N, K // g, g)
    if symmetric:
        s = (wf.abs().amax(-1) / 7.0).half()
        zero = torch.full_like(s, 8, dtype=torch.float32)
    else:
        lo, hi = wf.amin(-1).clamp(max=0), wf.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).half()
        zero = (-lo / s.float()).round().clamp(0, 15)
    q = (wf / s.float()[..., None] + zero[..., None]).round().clamp(0, 15)  # (from float16 scales)
    return q.reshape(N, K).to(torch.uint8), s, zero.to(torch.uint8)


def _words(vals: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, C/8]: word c's nibble i holds column 8c + order[i]."""
    v = vals.contiguous().to(torch.int64).reshape(vals.shape[0], -1, 8)[..., list(order)]
    word = sum(v[..., i] << (4 * i) for i in range(8))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32).contiguous()


def _layout(fmt: str, q, s, z, group):
    """The checkpoint tensors of one projection in fmt's layout: {suffix: tensor}."""
    if fmt == "awq":  # [K, N/8] packed along N in AWQ's order
        return {"qweight": _words(q.t(), AWQ_ORDER), "qzeros": _words(z.t(), AWQ_ORDER), "scales": s.t().contiguous()}
    if fmt.startswith("gptq"):  # [K/8, N] packed along K; v1 stores each zero point less one
        zeros = (z.t().to(torch.int16) - (1 if fmt == "gptq" else 0)) & 0xF
        K = q.shape[1]
        return {"qweight": _words(q).t().contiguous(), "qzeros": _words(zeros.to(torch.uint8)),
                "scales": s.t().contiguous(),
                "g_idx": torch.arange(K, dtype=torch.int32) // (K if group == -1 else group)}
    return {"weight_packed": _words(q), "weight_scale": s,  # compressed-tensors: [N, K/8]
            "weight_shape": torch.tensor(list(q.shape))}


def _config(fmt: str, group: int) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
                "checkpoint_format": fmt}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel" if group == -1 else "group",
                "group_size": None if group == -1 else group}}}}


def _rewrite_projections(src, dst, qconfig: dict, convert) -> dict[str, torch.Tensor]:
    """src copied to dst with each projection's weight replaced by convert(name, weight) -> (the
    checkpoint's tensors by suffix, the weight dequantized), and qconfig as its quantization_config
    -> {weight name: dequantized}."""
    shutil.copytree(src, dst)
    dequantized = {}
    for f in dst.glob("*.safetensors"):
        out = {}
        for name, t in load_file(str(f)).items():
            if not _is_proj(name):
                out[name] = t
                continue
            tensors, dequantized[name] = convert(name, t)
            out.update({name[:-len("weight")] + k: v for k, v in tensors.items()})
        save_file(out, str(f), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantized


def write_int4_checkpoint(src, dst, fmt: str, group: int = 128, zero_bias: bool = False) -> dict[str, torch.Tensor]:
    """The 16-bit checkpoint src rewritten as a 4-bit one in format fmt -> {weight name: dequantized}."""
    def convert(name, t):
        q, s, z = _quantize(t.float(), group, symmetric=fmt == "compressed-tensors")
        if fmt == "compressed-tensors":  # llm-compressor keeps a bf16 model's scales in bf16
            s = s.to(torch.bfloat16)
        tensors = _layout(fmt, q, s, z, group)
        if zero_bias:  # as AutoGPTQ saves for layers without a bias
            tensors["bias"] = torch.zeros(t.shape[0], dtype=t.dtype)
        g = q.shape[1] // s.shape[1]
        return tensors, (q.float() - z.float().repeat_interleave(g, 1)) * s.float().repeat_interleave(g, 1)

    return _rewrite_projections(src, dst, _config(fmt, group), convert)


def hf_with(path, weights: dict[str, torch.Tensor]):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w)
    return model


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """K of 256 (hidden) and 512 (MLP): two to sixteen groups, and whole groups on each of two ranks."""
    return build_model("llama", tmp_path_factory.mktemp("wide"), hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("fmt,group", [("awq", 128), ("gptq", 64), ("gptq_v2", 128), ("compressed-tensors", 32),
                                       ("compressed-tensors", -1)])
def test_int4_checkpoint_equals_transformers(wide_llama, tmp_path, fmt, group):
    dst = tmp_path / fmt
    weights = write_int4_checkpoint(wide_llama, dst, fmt, group, zero_bias=fmt == "gptq")
    assert len(weights) == 2 * len(PROJ)
    with LLM(str(dst), dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        model = llm.engine.runner.model
        assert isinstance(model.quant, Int4Format) and model.quant.group == group
        qkv = model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.int32 and qkv.weight_scale.dtype == torch.float16
        # the loaded weights are the checkpoint's, dequantized, in the engine's layout
        layer0 = [weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert torch.equal(reference.dequantize_int4(qkv.weight, qkv.weight_scale, qkv.weight_zero), torch.cat(layer0))
        hf = hf_with(wide_llama, weights)
        check_prompt_logprobs(llm, hf, prompts_of(4, 60, 3), max_gap=1e-3)
        prompts = make_prompts(3, n=4)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == model_greedy(hf, prompts, MAX_NEW)


def test_int4_checkpoint_with_qkv_bias(tmp_path):
    """Qwen2's 16-bit qkv bias beside 4-bit weights (K of 64: one group a row at groups of 64)."""
    src = build_model("qwen2", tmp_path / "qwen2")
    weights = write_int4_checkpoint(src, tmp_path / "awq", "awq", 64)
    with LLM(str(tmp_path / "awq"), dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.bias.dtype == torch.float32
        check_prompt_logprobs(llm, hf_with(src, weights), prompts_of(3, 40, 8), max_gap=1e-3)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_checkpoint_tp2_equals_transformers(wide_llama, tmp_path, fmt):
    """Two ranks (gloo) each load their rows, or their K's words, scales and zero points."""
    dst = tmp_path / fmt
    weights = write_int4_checkpoint(wide_llama, dst, fmt, 64)
    with LLM(str(dst), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        check_prompt_logprobs(llm, hf_with(wide_llama, weights), prompts_of(4, 60, 4), max_gap=1e-3)


# the projections that read one input share one act-order (GPTQ computes it from that input)
SAME_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp",
              "down_proj": "down"}


def write_act_order_checkpoint(src, dst, group: int, differ: str | None = None,
                               fmt: str = "gptq") -> dict[str, torch.Tensor]:
    """src rewritten as a checkpoint in activation order (fmt gptq: desc_act; compressed-tensors:
    actorder group), each input's columns shuffled into groups (the group index), each group
    quantized as a whole -> {weight name: dequantized}. differ: a projection whose order is its
    own, unlike the others with its input."""
    orders = {}

    def convert(name, t):
        proj = name.split(".")[-2]
        key = (name.split(".mlp.")[0].split(".self_attn.")[0], SAME_INPUT[proj] if proj != differ else proj)
        K = t.shape[1]
        if key not in orders:  # order[j]: the input column at group position j
            orders[key] = torch.randperm(K, generator=torch.Generator().manual_seed(len(orders)))
        order = orders[key]
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = torch.arange(K, dtype=torch.int32) // group
        q_sorted, s, z = _quantize(t.float()[:, order], group, symmetric=fmt == "compressed-tensors")
        back = torch.argsort(order)
        deq = (q_sorted.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)
        if fmt == "compressed-tensors":
            return {**_layout(fmt, q_sorted[:, back], s, z, group), "weight_g_idx": g_idx}, deq[:, back]
        zeros = (z.t().to(torch.int16) - 1) & 0xF  # GPTQ v1: each zero point less one
        return ({"qweight": _words(q_sorted[:, back]).t().contiguous(), "qzeros": _words(zeros.to(torch.uint8)),
                 "scales": s.t().contiguous(), "g_idx": g_idx}, deq[:, back])

    qconfig = _config(fmt, group)
    if fmt == "compressed-tensors":
        qconfig["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    else:
        qconfig["desc_act"] = True
    return _rewrite_projections(src, dst, qconfig, convert)


def _g_idx(folder, prefix: str, fmt: str) -> torch.Tensor:
    """A projection's group index as the checkpoint in folder holds it."""
    key = prefix + (".weight_g_idx" if fmt == "compressed-tensors" else ".g_idx")
    for f in folder.glob("*.safetensors"):
        tensors = load_file(str(f))
        if key in tensors:
            return tensors[key].to(torch.int64)
    raise KeyError(key)


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_activation_order_equals_transformers(wide_llama, tmp_path, fmt):
    """GPTQ's desc_act, compressed-tensors' actorder group: the loader sorts each weight's columns by
    group; the norms before q/k/v and gate/up write x in that order, gate/up's rows follow down's
    order, and o's input is gathered."""
    weights = write_act_order_checkpoint(wide_llama, tmp_path / "act", 64, fmt=fmt)
    with LLM(str(tmp_path / "act"), dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        model = llm.engine.runner.model
        assert model.quant.act_order
        layer = model.layers[0]
        qkv = layer.self_attn.qkv_proj
        perm = layer.input_layernorm.order
        assert qkv.weight_perm is None and perm is not None
        assert sorted(perm.tolist()) == list(range(256)) and perm.tolist() != list(range(256))
        assert layer.self_attn.o_proj.weight_perm is not None and layer.post_attention_layernorm.order is not None
        mlp = layer.mlp
        assert mlp.gate_up_proj.weight_perm is None and mlp.down_proj.weight_perm is None
        # gate/up's rows in down's group order: its first rows are gate's rows of down's first columns
        down_order = torch.argsort(_g_idx(tmp_path / "act", "model.layers.0.mlp.down_proj", fmt), stable=True)
        gate = weights["model.layers.0.mlp.gate_proj.weight"][:, layer.post_attention_layernorm.order]
        got = reference.dequantize_int4(mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale,
                                        mlp.gate_up_proj.weight_zero)
        assert torch.equal(got[:len(down_order)], gate[down_order])
        # the loaded weight is the checkpoint's, its columns in group order
        layer0 = torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(reference.dequantize_int4(qkv.weight, qkv.weight_scale, qkv.weight_zero), layer0[:, perm])
        hf = hf_with(wide_llama, weights)
        check_prompt_logprobs(llm, hf, prompts_of(4, 60, 3), max_gap=1e-3)
        prompts = make_prompts(3, n=4)
        greedy = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert greedy == model_greedy(hf, prompts, MAX_NEW)
    if fmt == "gptq":  # two pipeline stages: the second's first norm reorders the carry it receives
        with LLM(str(tmp_path / "act"), dtype="float32", device="cpu", num_kv_blocks=64,
                 pipeline_parallel_size=2) as llm:
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == greedy
    # dummy weights with the act-order config: identity orders, the same tokens run to run
    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    shutil.copy(tmp_path / "act" / "config.json", cfg_only / "config.json")
    runs = []
    for _ in range(2):
        with LLM(str(cfg_only / "config.json"), dtype="float32", device="cpu", num_kv_blocks=64,
                 load_format="dummy") as llm:
            o_proj = llm.engine.runner.model.layers[1].self_attn.o_proj
            assert torch.equal(o_proj.weight_perm, torch.arange(len(o_proj.weight_perm)))
            runs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert runs[0] == runs[1]
    with LLM(str(cfg_only / "config.json"), dtype="float32", device="cpu", num_kv_blocks=64, load_format="dummy",
             tensor_parallel_size=2) as llm:  # the same model cut in two (o: the rank's columns, then zeros)
        o_proj = llm.engine.runner.model.layers[1].self_attn.o_proj
        assert o_proj.weight_perm.tolist() == list(range(128)) + [-1] * 128
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == runs[0]
    # two ranks: q/k/v and gate/up keep their whole input (their rows split, gate/up's in down's
    # group order); down takes its share of the groups, o every group with its columns and zeros
    with LLM(str(tmp_path / "act"), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        layer = llm.engine.runner.model.layers[0]
        o, down = layer.self_attn.o_proj, layer.mlp.down_proj
        assert down.weight_perm is None and down.weight.shape[1] * 8 == 256  # 512 / 2
        assert len(o.weight_perm) == 256 and o.weight.shape[1] * 8 == 256 and (o.weight_perm == -1).sum() == 128
        assert sorted(o.weight_perm[o.weight_perm >= 0].tolist()) == list(range(128))
        assert layer.self_attn.qkv_proj.weight_perm is not None
        check_prompt_logprobs(llm, hf, prompts_of(4, 60, 3), max_gap=1e-3)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == greedy


def test_gptq_act_order_differing_within_a_packed_weight_is_one_error(wide_llama, tmp_path):
    write_act_order_checkpoint(wide_llama, tmp_path / "act", 64, differ="v_proj")
    with pytest.raises(Exception, match="act-order differs from the other projections packed with it"):
        LLM(str(tmp_path / "act"), dtype="float32", device="cpu", num_kv_blocks=64)


def test_groups_a_rank_would_cut_are_one_clear_error(wide_llama, tmp_path):
    """o_proj's 256 input columns over two ranks cannot keep groups of 256 whole."""
    dst = tmp_path / "awq"
    write_int4_checkpoint(wide_llama, dst, "awq", 256)
    with pytest.raises(RuntimeError, match="does not split into groups of 256; use fewer ranks"):
        LLM(str(dst), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64)


def test_dummy_weights_in_4_bits(tiny_models, tmp_path):
    """A 4-bit checkpoint's config.json with dummy weights, on one rank and as two pipeline stages:
    every projection 4-bit, the output repeatable and the same either way."""
    dst = tmp_path / "cfg"
    dst.mkdir()
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    cfg["quantization_config"] = _config("awq", 32)
    (dst / "config.json").write_text(json.dumps(cfg))
    prompts = make_prompts(5, n=3)
    runs = []
    for kw in ({}, {}, {"pipeline_parallel_size": 2}):
        with LLM(str(dst / "config.json"), dtype="float32", device="cpu", num_kv_blocks=64, load_format="dummy",
                 **kw) as llm:
            if not kw:
                w = llm.engine.runner.model.layers[0].mlp.gate_up_proj
                assert w.weight.dtype == torch.int32 and w.weight_zero.shape == (64 // 32, w.weight.shape[0])
            runs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert runs[0] == runs[1] == runs[2]


def test_unsupported_4_bit_checkpoints_are_one_clear_error(tiny_models):
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    for q, words in (({"quant_method": "awq", "bits": 8}, "AWQ checkpoints of 8 bits"),
                     ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
                     ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "groups of 100"),
                     ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
                     ({"quant_method": "bitsandbytes"}, "'bitsandbytes' are not supported"),
                     ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
                         "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                         "symmetric": False}}}}, "asymmetric"),
                     ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
                         "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                         "actorder": "dynamic"}}}}, "actorder 'dynamic'")):
        with pytest.raises(ModelConfigError, match=words):
            ModelConfig.from_dict({**cfg, "quantization_config": q})


def test_int4_mixture_of_experts_is_refused(tmp_path):
    path = build_model("qwen3_moe", tmp_path / "moe")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = _config("awq", 32)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match="4-bit weights .* mixture of experts"):
        LLM(str(path / "config.json"), dtype="float32", device="cpu", num_kv_blocks=32, load_format="dummy")


def test_kv_calc_counts_4_bit_projections():
    from dataclasses import replace

    from engine.presets import resolve_model
    from kvcache.calc import weight_bytes_per_gpu

    bf16 = resolve_model("Llama-3-8B").config
    int4 = replace(bf16, quant=Int4Format("awq", 128))
    p = bf16.projection_params()
    saved = weight_bytes_per_gpu(bf16, "bfloat16") - weight_bytes_per_gpu(int4, "bfloat16")
    assert saved == int(p * (2 - 0.5 - 3 / 128))
    # act-order over two ranks: o as wide as the whole weight on each (engine/parallel/layers.py)
    act, plain = (replace(bf16, quant=Int4Format("gptq", 128, act_order=a)) for a in (True, False))
    extra = weight_bytes_per_gpu(act, "bfloat16", 2) - weight_bytes_per_gpu(plain, "bfloat16", 2)
    assert abs(extra - 32 * 4096 * 4096 / 2 * (0.5 + 3 / 128)) <= 1
    assert weight_bytes_per_gpu(act, "bfloat16") == weight_bytes_per_gpu(plain, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-act-order"])
def test_gpu_int4_checkpoint_equals_transformers(wide_llama, tmp_path, fmt):
    """On the GPU (float32 activations): kernels/int4.py through whole-step, piecewise and decode
    graphs, prompts chunked beside decodes; greedy as transformers' with the dequantized weights."""
    dst = tmp_path / fmt
    if fmt == "gptq-act-order":  # x gathered by the weight's order inside the graphs too
        weights = write_act_order_checkpoint(wide_llama, dst, 64)
    else:
        weights = write_int4_checkpoint(wide_llama, dst, fmt, 64)
    hf = hf_with(wide_llama, weights)
    prompts = prompts_of(4, 60, 7)
    with LLM(str(dst), dtype="float32", max_num_batched_tokens=48) as llm:
        runner = llm.engine.runner
        assert runner.steps is not None and runner.piecewise is not None
        check_prompt_logprobs(llm, hf, prompts, max_gap=1e-3)
        outs = llm.generate(prompts, GREEDY)
    check_greedy_near_best(hf, prompts, outs, 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_act_order_equals_transformers(wide_llama, tmp_path):
    """An act-order checkpoint over two GPUs (o's padded gather, down's groups in order, the
    kernels and graphs): prompt logprobs and greedy tokens as transformers' dequantized weights."""
    dst = tmp_path / "act"
    weights = write_act_order_checkpoint(wide_llama, dst, 64)
    hf = hf_with(wide_llama, weights)
    prompts = prompts_of(4, 60, 7)
    with LLM(str(dst), dtype="float32", max_num_batched_tokens=48, tensor_parallel_size=2) as llm:
        check_prompt_logprobs(llm, hf, prompts, max_gap=1e-3)
        outs = llm.generate(prompts, GREEDY)
    check_greedy_near_best(hf, prompts, outs, 1e-3)
