"""FP8 weights (engine/quant.py): FP8 checkpoints in each format the engine reads, and `quantization
="fp8"` on a 16-bit one, compute what transformers computes for the same model with its projections'
weights dequantized and their inputs quantized per token (and group of 128) as kernels/fp8.py does."""
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, ModelConfigError
from engine.quant import QuantizationError, quantize_weight
from kernels import reference
from serve import LLM, SamplingParams
from tests.engine.test_equal_transformers import make_prompts
from tests.models import VOCAB, build_model, model_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FORMATS = {
    "fp8-blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128]}, "weight_scale_inv", "block"),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "weight_scale", "tensor"),
    "compressed-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                      "dynamic": True}}}}, "weight_scale", "channel"),
}


def _is_proj(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJ


def quantize_tensor(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    if strategy == "tensor":
        scale = (w.abs().max() / 448.0).clamp(min=1e-12)
        return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(1)
    return quantize_weight(w, blocked=strategy == "block")


def write_fp8_checkpoint(src, dst, fmt: str):
    """The 16-bit checkpoint src rewritten as an FP8 one in format fmt -> {weight name: dequantized}."""
    qcfg, scale_name, strategy = FORMATS[fmt]
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors, dequantized = load_file(str(f)), {}
        out = {}
        for name, t in tensors.items():
            if not _is_proj(name):
                out[name] = t
                continue
            q, s = quantize_tensor(t.float(), strategy)
            out[name] = q
            out[name[:-len("weight")] + scale_name] = s
            if fmt == "fp8-tensor":  # what a static checkpoint also carries, unused here
                out[name[:-len("weight")] + "input_scale"] = torch.ones(1)
            dequantized[name] = q.float() * (s if s.numel() == 1 else _expand(s, q.shape))
        save_file(out, str(f), metadata={"format": "pt"})
        yield from dequantized.items()
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))


def _expand(s: torch.Tensor, shape) -> torch.Tensor:
    if s.shape[1] == 1 and s.shape[0] == shape[0]:
        return s
    return s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]


def hf_w8a8(path, weights: dict[str, torch.Tensor], blocked: bool, ranks: int = 1):
    """transformers' model with the projections' weights replaced by `weights` and each projection's
    input quantized per token (per group of 128 with blocks), as the kernels do; with ranks > 1
    o_proj's and down_proj's inputs are quantized in ranks parts, as each tensor-parallel rank
    quantizes its own share of their K."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    state = model.state_dict()

    def quantize_input(parts: int):
        def hook(module, args):
            x = args[0]
            out = []
            for flat in x.reshape(-1, x.shape[-1]).chunk(parts, dim=1):
                q, s = reference.quantize_fp8(flat, 128 if blocked else flat.shape[1])
                out.append(reference.dequantize_fp8(q, s))
            return (torch.cat(out, dim=1).view_as(x),)
        return hook

    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w)
            row_parallel = name.split(".")[-2] in ("o_proj", "down_proj")
            model.get_submodule(name[:-len(".weight")]).register_forward_pre_hook(
                quantize_input(ranks if row_parallel else 1))
    return model


def check_prompt_logprobs(llm: LLM, model, prompts, max_gap: float = 0.2) -> None:
    """The engine's logprob of every prompt token equals the model's (log-softmax of its logits):
    within float32 rounding at nearly every position (median), and within 0.2 where a rounding
    difference moved an input across an FP8 rounding boundary. Without the inputs quantized the
    median difference is ~0.1 (W8A16), with wrong scales the logprobs are noise."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    diffs = []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            want = model(torch.tensor([p])).logits[0].log_softmax(-1)[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
            diffs.append((torch.tensor(list(o.prompt_logprobs.logprobs[1:])) - want).abs())
    d = torch.cat(diffs)
    assert d.median() < 1e-4 and d.max() < max_gap, (d.median(), d.max())


def prompts_of(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A Llama whose projections span several 128 x 128 blocks, and whose K, cut in two by tensor
    parallelism, still falls on whole blocks; its 64-row KV heads straddle blocks of the packed qkv."""
    return build_model("llama", tmp_path_factory.mktemp("wide"), hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_equals_transformers(wide_llama, tmp_path, fmt):
    dst = tmp_path / fmt
    weights = dict(write_fp8_checkpoint(wide_llama, dst, fmt))
    assert len(weights) == 2 * len(PROJ)
    blocked = FORMATS[fmt][2] == "block"
    with LLM(str(dst), dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn
        # the loaded weights are the checkpoint's, dequantized
        layer0 = [weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert torch.equal(reference.dequantize_fp8(qkv.weight, qkv.weight_scale), torch.cat(layer0))
        check_prompt_logprobs(llm, hf_w8a8(wide_llama, weights, blocked), prompts_of(4, 60, 3))


def test_fp8_checkpoint_with_qkv_bias_and_small_heads(tiny_models, tmp_path):
    """Qwen2's 16-bit qkv bias beside an FP8 weight; K below one block; greedy as transformers."""
    dst = tmp_path / "qwen2"
    weights = dict(write_fp8_checkpoint(tiny_models["qwen2"], dst, "fp8-blocks"))
    prompts = make_prompts(3, n=4)
    want = model_greedy(hf_w8a8(tiny_models["qwen2"], weights, True), prompts, MAX_NEW)
    with LLM(str(dst), dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.bias.dtype == torch.float32
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


@pytest.mark.parametrize("fmt", ["fp8-blocks", "compressed-channel"])
def test_fp8_checkpoint_tp2_equals_transformers(wide_llama, tmp_path, fmt):
    """Two ranks (gloo) each load their rows or columns of the FP8 weights and their scales (each
    rank's one KV head of 64 rows takes per-row block scales)."""
    dst = tmp_path / fmt
    weights = dict(write_fp8_checkpoint(wide_llama, dst, fmt))
    model = hf_w8a8(wide_llama, weights, FORMATS[fmt][2] == "block", ranks=2)
    with LLM(str(dst), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64) as llm:
        check_prompt_logprobs(llm, model, prompts_of(4, 60, 4))


def test_blocks_a_rank_would_cut_are_one_clear_error(tiny_models, tmp_path):
    dst = tmp_path / "blocks"
    dict(write_fp8_checkpoint(tiny_models["llama"], dst, "fp8-blocks"))
    with pytest.raises(RuntimeError, match="does not align with the checkpoint's 128 x 128 FP8 blocks; use fewer"):
        LLM(str(dst), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64)


def test_quantization_fp8_at_load_equals_transformers(wide_llama):
    weights = {}
    for f in wide_llama.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            if _is_proj(name):
                q, s = quantize_weight(t.float(), blocked=False)
                weights[name] = q.float() * s
    with LLM(str(wide_llama), dtype="float32", device="cpu", num_kv_blocks=64, quantization="fp8") as llm:
        assert llm.engine.runner.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        check_prompt_logprobs(llm, hf_w8a8(wide_llama, weights, False), prompts_of(4, 60, 5))


def test_dummy_weights_in_fp8(tiny_models, tmp_path):
    """An FP8 checkpoint's config.json with dummy weights, and --quantization fp8 with them: every
    projection FP8, the output finite and repeatable."""
    dst = tmp_path / "cfg"
    dst.mkdir()
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    cfg["quantization_config"] = FORMATS["fp8-blocks"][0]
    (dst / "config.json").write_text(json.dumps(cfg))
    prompts = make_prompts(5, n=3)
    runs = []
    for path, kw in ((dst / "config.json", {}), (tiny_models["llama"] / "config.json", {"quantization": "fp8"})):
        for _ in range(2):
            llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, load_format="dummy", **kw)
            w = llm.engine.runner.model.layers[0].mlp.gate_up_proj
            assert w.weight.dtype == torch.float8_e4m3fn
            assert w.weight_scale.shape == ((2, 1) if not kw else (w.weight.shape[0], 1))  # gate|up: 2 x 128 rows
            runs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert runs[0] == runs[1] and runs[2] == runs[3]


def test_quantization_of_a_quantized_checkpoint_is_refused(tiny_models, tmp_path):
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    cfg["quantization_config"] = FORMATS["fp8-blocks"][0]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="already; drop --quantization"):
        LLM(str(tmp_path / "config.json"), device="cpu", load_format="dummy", quantization="fp8")


def test_unsupported_quantization_is_one_clear_error(tiny_models):
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    for q, words in (({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' are not supported"),
                     ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "blocks of [64, 64]"),
                     ({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.mlp"]}, "unquantized"),
                     ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
                         "num_bits": 8, "type": "int", "strategy": "channel"}}}}, "8-bit int")):
        with pytest.raises(ModelConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ModelConfig.from_dict({**cfg, "quantization_config": q})
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        LLM(str(tiny_models["llama"]), device="cpu", quantization="int4")


def test_fp8_mixture_of_experts_is_refused(tmp_path):
    path = build_model("qwen3_moe", tmp_path / "moe")
    with pytest.raises(QuantizationError, match="mixture of experts"):
        LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, quantization="fp8", load_format="dummy")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8-blocks", "compressed-channel"])
def test_gpu_fp8_checkpoint_equals_transformers(wide_llama, tmp_path, fmt):
    """On the GPU (float32 activations, so the kernels' FP8 inputs are the reference's): kernels/fp8.py
    through whole-step, piecewise and decode graphs, prompts chunked beside decodes; each greedy
    token the model's best, or within float rounding of it."""
    dst = tmp_path / fmt
    weights = dict(write_fp8_checkpoint(wide_llama, dst, fmt))
    model = hf_w8a8(wide_llama, weights, FORMATS[fmt][2] == "block")
    prompts = prompts_of(4, 60, 7)
    with LLM(str(dst), dtype="float32", max_num_batched_tokens=48) as llm:
        runner = llm.engine.runner
        assert runner.steps is not None and runner.piecewise is not None
        check_prompt_logprobs(llm, model, prompts)
        outs = llm.generate(prompts, GREEDY)
    check_greedy_near_best(model, prompts, outs, 0.2)


def check_greedy_near_best(model, prompts, outs, max_gap: float) -> None:
    """Each greedy token is the model's best, or within max_gap (float rounding) of its logprob."""
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            logprobs = model(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
            chosen = logprobs.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
            assert (logprobs.max(-1).values - chosen).max() < max_gap


def test_kv_calc_counts_fp8_projections(tiny_models):
    """serve kv-calc: an FP8 model's projections at one byte a weight, on every rank and stage; more
    KV blocks fit."""
    from dataclasses import replace

    from engine.quant import AT_LOAD
    from engine.presets import resolve_model
    from kvcache.calc import quant_saving, stage_weight_bytes, weight_bytes_per_gpu

    bf16 = resolve_model("Llama-3-8B").config
    fp8 = replace(bf16, quant=AT_LOAD)
    p = bf16.projection_params()
    assert weight_bytes_per_gpu(bf16, "bfloat16") - weight_bytes_per_gpu(fp8, "bfloat16") == p
    assert weight_bytes_per_gpu(bf16, "bfloat16", 2) - weight_bytes_per_gpu(fp8, "bfloat16", 2) == p // 2
    half = bf16.num_layers // 2
    assert (stage_weight_bytes(bf16, "bfloat16", 1, half, True, False)
            - stage_weight_bytes(fp8, "bfloat16", 1, half, True, False)) \
        == quant_saving(fp8, "bfloat16", 1, half) == p // 2
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    checkpoint = ModelConfig.from_dict({**cfg, "quantization_config": FORMATS["fp8-blocks"][0]})
    assert checkpoint.quant is not None and quant_saving(checkpoint, "bfloat16") == checkpoint.projection_params()
