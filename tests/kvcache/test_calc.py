"""The sizing arithmetic: kv_cache_bytes, plan(), the weight, activation and graph estimates."""
from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ModelConfig
from kvcache import calc
from kvcache.calc import (KVCalcInputError, NoRoomForKVCacheError, WeightsDontFitError, estimate_activation_bytes,
                          kv_cache_bytes, plan, weight_bytes_per_gpu)
from engine.presets import MODEL_PRESETS, resolve_model
from kvcache.gpus import GiB, resolve_gpu_memory
from kvcache.spec import KVCacheSpec

H100 = resolve_gpu_memory("H100").total_bytes


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


def test_cpu_pool_fits_the_work_within_a_share_of_ram():
    spec = KVCacheSpec(30, 3, 64, 16, "float32")
    ram = 20 * GiB
    # 4 sequences of 2,048 tokens: what they can use at most
    assert calc.cpu_kv_blocks(spec, 4, 2048, ram) == 4 * 128
    # 256 of 8,192 tokens would take 96 GiB: capped by the share of the RAM
    capped = calc.cpu_kv_blocks(spec, 256, 8192, ram)
    assert capped == spec.num_blocks_for(int(ram * calc.CPU_KV_RAM_SHARE)) < 256 * 512
    assert calc.cpu_kv_blocks(spec, 256, 8192, 0) == 1
