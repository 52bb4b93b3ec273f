"""The sizing calculator: kv_cache_bytes, plan(), presets, and the `serve kv-calc` CLI."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ModelConfig
from kvcache import calc
from kvcache.calc import (KVCalcInputError, NoRoomForKVCacheError, WeightsDontFitError, estimate_activation_bytes,
                          kv_cache_bytes, plan, weight_bytes_per_gpu)
from kvcache.presets import (GPU_PRESETS, MODEL_PRESETS, GiB, PresetError, find_model_preset, parse_size,
                             resolve_gpu_memory, resolve_model)
from kvcache.spec import KVCacheSpec

REPO = Path(__file__).resolve().parents[2]
H100 = resolve_gpu_memory("H100").total_bytes
JSON_KEYS = {"weight_bytes", "bytes_per_token", "bytes_per_block", "num_blocks", "max_tokens", "max_concurrent_seqs"}


def preset(name: str) -> ModelConfig:
    return resolve_model(name).config


# ---------------------------------------------------------------- the budget


def test_kv_cache_bytes_subtracts_from_the_budget():
    total = 80 * GiB
    assert kv_cache_bytes(total, 0.9, 16 * 10**9, 2 * 10**9, 10**9) == int(total * 0.9) - 19 * 10**9
    assert kv_cache_bytes(total, 1.0, 0, 0) == total


def test_kv_cache_bytes_is_never_negative():
    assert kv_cache_bytes(8 * GiB, 0.9, 16 * 10**9, 0) == 0


@pytest.mark.parametrize("util", [0.0, -0.5, 1.01])
def test_kv_cache_bytes_rejects_bad_utilization(util):
    with pytest.raises(KVCalcInputError, match="utilization"):
        kv_cache_bytes(80 * GiB, util, 0, 0)


def test_kv_cache_bytes_rejects_negative_inputs():
    with pytest.raises(KVCalcInputError):
        kv_cache_bytes(0, 0.9, 0, 0)
    with pytest.raises(KVCalcInputError):
        kv_cache_bytes(80 * GiB, 0.9, 0, -1)


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("name, params", [
    # the public parameter counts of these checkpoints
    ("Llama-3-8B", 8_030_261_248), ("Llama-3-70B", 70_553_706_496), ("Qwen2.5-0.5B", 494_032_768),
    ("Qwen2.5-7B", 7_615_616_512), ("Mistral-7B", 7_248_023_552), ("Qwen3-8B", 8_190_735_360),
])
def test_preset_shapes_give_the_public_parameter_counts(name, params):
    assert preset(name).num_params() == params


def test_weight_bytes_follow_dtype():
    m = preset("Llama-3-8B")
    assert weight_bytes_per_gpu(m, "bfloat16") == 2 * 8_030_261_248
    assert weight_bytes_per_gpu(m, "float32") == 4 * 8_030_261_248


def test_tensor_parallel_splits_weights_but_not_norms():
    m = preset("Llama-3-70B")
    whole = weight_bytes_per_gpu(m, "bfloat16")
    norms = (m.num_layers * 2 * m.hidden_size + m.hidden_size) * 2
    for tp in (2, 4, 8):
        per_gpu = weight_bytes_per_gpu(m, "bfloat16", tp)
        assert per_gpu * tp - whole == pytest.approx(norms * (tp - 1), abs=2 * tp)


def test_tensor_parallel_copies_kv_projections_when_ranks_outnumber_kv_heads():
    m = preset("Llama-3-70B")  # 8 KV heads
    split = weight_bytes_per_gpu(m, "bfloat16", 8) * 8
    replicated = weight_bytes_per_gpu(m, "bfloat16", 16) * 16
    norms = (m.num_layers * 2 * m.hidden_size + m.hidden_size) * 2
    kv_proj_copies = m.num_layers * 2 * 8 * m.head_dim * m.hidden_size * 2  # 8 more heads' k and v
    assert replicated - split == pytest.approx(kv_proj_copies + 8 * norms, abs=64)


# ---------------------------------------------------------------- plan()


def test_plan_llama3_8b_by_hand():
    m = preset("Llama-3-8B")
    p = plan(m, 80 * GiB, 0.9, activation_bytes=2 * GiB, graph_bytes=GiB // 2)
    weights = 2 * 8_030_261_248
    kv = int(80 * GiB * 0.9) - weights - 2 * GiB - GiB // 2
    assert (p.weight_bytes, p.kv_cache_bytes) == (weights, kv)
    assert (p.bytes_per_token, p.bytes_per_block) == (131072, 2 * 1024 * 1024)
    assert p.num_blocks == kv // (2 * 1024 * 1024)
    assert p.max_tokens == p.num_blocks * 16
    assert p.max_model_len == 8192  # the model's max_position_embeddings
    assert p.max_concurrent_seqs == p.num_blocks // 512
    assert (p.kv_dtype, p.dtype, p.activation_estimated) == ("bfloat16", "bfloat16", False)


def test_plan_uses_the_shared_spec():
    m = preset("Qwen3-8B")
    p = plan(m, H100, kv_cache_dtype="fp8", tensor_parallel_size=2, block_size=32)
    assert p.spec == KVCacheSpec.for_model(m.num_layers, m.num_kv_heads, m.head_dim, 32, "fp8", 2)


def test_plan_max_model_len_sets_concurrency():
    m = preset("Llama-3-8B")
    p = plan(m, H100, max_model_len=2000, activation_bytes=GiB)
    assert p.max_concurrent_seqs == p.num_blocks // 125  # 2000 tokens take 125 blocks of 16


def test_fp8_and_int8_hold_about_twice_the_tokens():
    m = preset("Llama-3-8B")
    plans = {d: plan(m, H100, kv_cache_dtype=d) for d in ("auto", "fp8", "int8")}
    assert plans["fp8"].bytes_per_token == plans["int8"].bytes_per_token == 67584
    assert plans["auto"].weight_bytes == plans["fp8"].weight_bytes
    assert 1.9 < plans["fp8"].max_tokens / plans["auto"].max_tokens < 2.0


def test_with_kv_dtype_keeps_the_budget():
    p = plan(preset("Llama-3-8B"), H100)
    q = p.with_kv_dtype("int8")
    assert (q.kv_dtype, q.kv_cache_bytes, q.weight_bytes) == ("int8", p.kv_cache_bytes, p.weight_bytes)


def test_plan_tensor_parallel_is_per_gpu():
    m = preset("Llama-3-70B")
    p = plan(m, H100, tensor_parallel_size=4)
    assert p.spec.num_kv_heads == 2
    assert p.bytes_per_token == 80 * 2 * 2 * 128 * 2
    assert p.weight_bytes == weight_bytes_per_gpu(m, "bfloat16", 4)


@pytest.mark.parametrize("tp", [3, 5, 0])
def test_plan_rejects_tensor_parallel_that_does_not_divide(tp):
    with pytest.raises(KVCalcInputError, match="tensor-parallel-size"):
        plan(preset("Llama-3-8B"), H100, tensor_parallel_size=tp)


def test_plan_rejects_tp_that_divides_heads_but_not_kv_heads():
    cfg = dict(MODEL_PRESETS[0].config_dict(), num_attention_heads=12, num_key_value_heads=4, head_dim=128)
    with pytest.raises(KVCalcInputError, match="KV heads"):
        plan(ModelConfig.from_dict(cfg), H100, tensor_parallel_size=3)


def test_weights_dont_fit_says_what_to_do():
    with pytest.raises(WeightsDontFitError) as e:
        plan(preset("Llama-3-70B"), H100, model_name="Llama-3-70B")
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert "Llama-3-70B needs 131.4 GiB of weights in bfloat16" in msg
    assert "x 0.90 = 71.3 GiB" in msg
    assert "--tensor-parallel-size 2 or more" in msg


def test_weights_dont_fit_suggests_a_bigger_gpu_when_no_split_helps():
    with pytest.raises(WeightsDontFitError, match="more memory"):
        plan(preset("Llama-3-8B"), 10**9)


def test_no_room_left_for_one_block():
    m = preset("Llama-3-8B")
    with pytest.raises(NoRoomForKVCacheError, match="no room"):
        plan(m, 18 * GiB, 0.9, activation_bytes=2 * GiB)


def test_plan_warns_when_one_sequence_does_not_fit():
    p = plan(preset("Llama-3-8B"), 18 * GiB, 0.9, activation_bytes=GiB)
    assert 0 < p.max_tokens < 8192 and p.max_concurrent_seqs == 0
    assert len(p.warnings) == 1 and f"lower max_model_len to {p.max_tokens:,}" in p.warnings[0]
    assert plan(preset("Llama-3-8B"), H100).warnings == ()


def test_plan_refuses_a_longer_context_than_the_model_has():
    with pytest.raises(KVCalcInputError, match="context length 8,192"):
        plan(preset("Llama-3-8B"), H100, max_model_len=8193)


def test_activation_estimate():
    m = preset("Llama-3-8B")
    est = estimate_activation_bytes(m, "bfloat16")
    # the MLP dominates: 8192 tokens x (3 x 4096 + 4 x 14336) x 2 bytes
    assert est.layer_bytes == 8192 * (3 * 4096 + 4 * 14336) * 2
    assert est.buffer_bytes == 8192 * 128 * 2 * 4  # the rope table: positions x head_dim x (cos, sin) x float32
    # the sampler at max_num_seqs rows (top-k, top-p, logprobs) outweighs the largest layer here
    assert est.logits_bytes == 2 * 8192 * 4096 * 2 + 256 * 128256 * (2 + 4 + calc.SAMPLER_BYTES_PER_LOGIT)
    assert est.total_bytes == max(est.layer_bytes, est.logits_bytes) + est.buffer_bytes + calc.RUNTIME_OVERHEAD_BYTES
    # like the engine's profile, no more tokens than max_model_len
    assert estimate_activation_bytes(m, "bfloat16", max_model_len=1024).profile_tokens == 1024
    assert estimate_activation_bytes(m, "bfloat16", max_num_batched_tokens=2048).layer_bytes == est.layer_bytes // 4
    assert estimate_activation_bytes(m, "bfloat16", tensor_parallel_size=2).layer_bytes < est.layer_bytes
    p = plan(m, H100)
    assert p.activation_estimated and p.activation_bytes == est.total_bytes


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from([p.name for p in MODEL_PRESETS]), gib=st.integers(16, 200),
       util=st.floats(0.5, 1.0), kv=st.sampled_from(["auto", "fp8", "int8", "float16"]),
       block=st.sampled_from([8, 16, 32]), act=st.integers(0, 4 * GiB), tp=st.sampled_from([1, 2, 4]))
def test_plan_never_overcommits(name, gib, util, kv, block, act, tp):
    try:
        p = plan(preset(name), gib * GiB, util, kv, block_size=block, tensor_parallel_size=tp, activation_bytes=act)
    except (WeightsDontFitError, NoRoomForKVCacheError, KVCalcInputError):
        return
    assert p.num_blocks >= 1
    assert p.num_blocks * p.bytes_per_block <= p.kv_cache_bytes < (p.num_blocks + 1) * p.bytes_per_block
    assert p.weight_bytes + act + p.kv_cache_bytes == int(gib * GiB * util)
    assert p.max_concurrent_seqs * p.blocks_per_seq <= p.num_blocks


def test_defaults_match_the_engine():
    from serve.config import EngineConfig

    cfg = EngineConfig()
    assert (calc.DEFAULT_MAX_NUM_BATCHED_TOKENS, calc.DEFAULT_MAX_NUM_SEQS, calc.DEFAULT_STEP_GRAPH_MAX_TOKENS) == (
        cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.step_graph_max_tokens)
    args = parse()
    assert args.block_size is None and float(args.memory_utilization) == cfg.gpu_memory_utilization
    for kv, block_size in (("auto", 16), ("bfloat16", 16), ("fp8", 32), ("int8", 32)):
        assert EngineConfig(kv_cache_dtype=kv).block_size == block_size
        assert calc.plan(preset("llama3-8b"), 80 * GiB, kv_cache_dtype=kv).block_size == block_size
        assert EngineConfig(kv_cache_dtype=kv, block_size=64).block_size == 64


# ---------------------------------------------------------------- presets


def test_every_model_preset_name_and_alias_resolves_case_insensitively():
    for p in MODEL_PRESETS:
        for name in (p.name, p.name.upper(), p.name.lower(), *p.aliases):
            assert resolve_model(name).name == p.name


def test_common_spellings_resolve():
    assert find_model_preset("llama3-8b").name == "Llama-3-8B"
    assert find_model_preset("LLAMA_3_70B").name == "Llama-3-70B"
    assert find_model_preset("qwen2.5-0.5b").name == "Qwen2.5-0.5B"
    assert find_model_preset("mistral-7b").name == "Mistral-7B"
    assert find_model_preset("gpt-2") is None


def test_preset_names_do_not_collide():
    from kvcache.presets import _key
    for presets in (MODEL_PRESETS, GPU_PRESETS):
        keys = [(_key(n), p.name) for p in presets for n in {p.name, *p.aliases}]
        owners: dict[str, set[str]] = {}
        for key, owner in keys:
            owners.setdefault(key, set()).add(owner)
        assert all(len(o) == 1 for o in owners.values()), owners


def test_model_from_folder_and_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS[2].config_dict()))
    from_folder = resolve_model(str(tmp_path))
    from_file = resolve_model(str(tmp_path / "config.json"))
    assert from_folder.config == from_file.config == preset("Qwen2.5-0.5B")
    assert from_folder.name == tmp_path.name


def test_unknown_model_lists_the_presets():
    with pytest.raises(PresetError, match="Llama-3-8B"):
        resolve_model("no-such-model")


@pytest.mark.parametrize("text, size", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("80 gib", 80 * 2**30), ("80G", 80 * 2**30),
    ("1.5TiB", int(1.5 * 2**40)), ("512MiB", 512 * 2**20), ("24gb", 24 * 10**9), ("1073741824B", 2**30),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80", "abc", "0GB", "-1GB", "80XB", "", "GB"])
def test_parse_size_rejects(text):
    with pytest.raises(PresetError):
        parse_size(text)


@pytest.mark.parametrize("name, canonical", [
    ("H100", "H100-80GB"), ("h100-80gb", "H100-80GB"), ("H100 80GB", "H100-80GB"), ("A100-40GB", "A100-40GB"),
    ("a100-80gb", "A100-80GB"), ("L4", "L4"), ("RTX4090", "RTX4090"), ("rtx-4090", "RTX4090"), ("H200", "H200"),
])
def test_gpu_presets(name, canonical):
    assert resolve_gpu_memory(name).label == canonical


def test_gpu_preset_sizes():
    assert resolve_gpu_memory("H100").total_bytes == 85_017_493_504  # what CUDA reports on an H100 80GB HBM3
    assert resolve_gpu_memory("A100-40GB").total_bytes == 40960 * 2**20
    assert resolve_gpu_memory("80GiB").total_bytes == 80 * GiB


def test_unknown_gpu_lists_the_presets():
    with pytest.raises(PresetError, match="H100-80GB"):
        resolve_gpu_memory("TPUv5")


# ---------------------------------------------------------------- the CLI


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve kv-calc")
    calc.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_text(capsys):
    assert calc.run(parse("--model", "llama3-8b", "--gpu-memory", "H100")) == 0
    out = capsys.readouterr().out
    for needle in ("Llama-3-8B on H100-80GB", "weights (bfloat16)", "KV bytes per token", "131,072",
                   "2,097,152", "blocks", "tokens that fit", "sequences of 8,192 tokens", "fp8", "int8", "estimate"):
        assert needle in out
    p = calc.plan_request(calc.read_request(parse("--model", "llama3-8b", "--gpu-memory", "H100")))
    assert f"{p.num_blocks:,}" in out and f"{p.max_tokens:,}" in out
    # the graph reserve is the engine's own estimate, counted before the KV cache
    assert p.graph_bytes == (calc.estimate_graph_bytes(preset("Llama-3-8B"), "bfloat16", 256, 8192, 16)
                             + calc.estimate_piecewise_graph_bytes(preset("Llama-3-8B"), "bfloat16", 8192)
                             + calc.estimate_step_graph_bytes(256, 8192, 16, 2304)) > 0


def test_cli_json(capsys):
    argv = ("--model", "Llama-3-8B", "--gpu-memory", "80GiB", "--kv-cache-dtype", "fp8", "--max-model-len", "4k",
            "--memory-utilization", "0.85", "--json")
    assert calc.run(parse(*argv)) == 0
    out = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= out.keys()
    graphs = (calc.estimate_graph_bytes(preset("Llama-3-8B"), "bfloat16", 256, 4096, 32)  # fp8 pages: block size 32
              + calc.estimate_piecewise_graph_bytes(preset("Llama-3-8B"), "bfloat16", 8192)
              + calc.estimate_step_graph_bytes(256, 4096, 32, 2304))
    p = plan(preset("Llama-3-8B"), 80 * GiB, 0.85, "fp8", max_model_len=4096, graph_bytes=graphs)
    assert {k: out[k] for k in JSON_KEYS} == {k: getattr(p, k) for k in JSON_KEYS}
    assert (out["bytes_per_token"], out["kv_cache_dtype"], out["max_model_len"]) == (67584, "fp8", 4096)
    assert [row["kv_cache_dtype"] for row in out["table"]] == ["bfloat16", "fp8", "int8"]
    assert out["activation_estimated"] is True


def test_cli_max_num_batched_tokens_changes_the_estimate(capsys):
    small = ("--model", "llama3-8b", "--gpu-memory", "H100", "--json", "--max-num-batched-tokens", "2048")
    assert calc.run(parse(*small)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["activation_bytes"] == plan(preset("Llama-3-8B"), H100, max_num_batched_tokens=2048).activation_bytes
    assert out["activation_bytes"] < plan(preset("Llama-3-8B"), H100).activation_bytes


def test_cli_tensor_parallel(capsys):
    assert calc.run(parse("--model", "llama3-70b", "--gpu-memory", "H100", "--tensor-parallel-size", "4", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tensor_parallel_size"], out["num_kv_heads_per_gpu"], out["bytes_per_token"]) == (4, 2, 81920)


def test_cli_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS[0].config_dict()))
    assert calc.run(parse("--model", str(tmp_path), "--gpu-memory", "H100", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 131072


@pytest.mark.parametrize("argv", [
    ("--model", "nope", "--gpu-memory", "H100"),
    ("--model", "llama3-8b", "--gpu-memory", "80"),
    ("--model", "llama3-8b", "--gpu-memory", "Voodoo5"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--memory-utilization", "0"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--memory-utilization", "lots"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--block-size", "0"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--block-size", "sixteen"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--block-size", "12"),  # serve run refuses it too
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--max-model-len", "100k"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--max-num-batched-tokens", "0"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--max-model-len", "-1"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--tensor-parallel-size", "-2"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--kv-cache-dtype", "fp4"),
    ("--model", "llama3-8b", "--gpu-memory", "H100", "--dtype", "int4"),
    ("--gpu-memory", "H100"),
    ("--model", "llama3-8b"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert calc.run(parse(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err


def test_cli_weights_dont_fit_exits_1(capsys):
    assert calc.run(parse("--model", "Llama-3-70B", "--gpu-memory", "H100")) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--tensor-parallel-size 2 or more" in err


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (131072, "128 KiB"), (1081344, "1.03 MiB"),
                                     (16_060_522_496, "14.96 GiB")])
def test_format_bytes(n, text):
    assert calc.format_bytes(n) == text


def test_measure_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --measure runs (see the gpu-marked test)")
    assert calc.run(parse("--measure", "--model", "llama3-8b")) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_python_dash_m():
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache.calc", "--model", "qwen2.5-0.5b", "--gpu-memory", "L4", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert JSON_KEYS <= out.keys()
    assert out["bytes_per_token"] == 12288
    bad = subprocess.run([sys.executable, "-m", "kvcache.calc", "--model", "qwen2.5-0.5b", "--gpu-memory", "lots"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
