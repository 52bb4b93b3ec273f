"""KVCacheSpec: bytes per token and per block, checked against sums done by hand."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.spec import SCALE_BYTES, KVCacheSpec, resolve_kv_dtype

# Llama-3-8B: 32 layers, 8 KV heads (of 32 query heads), head_dim 128
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)


def llama3_8b(dtype: str, block_size: int = 16, tp: int = 1) -> KVCacheSpec:
    return KVCacheSpec.for_model(**LLAMA3_8B, block_size=block_size, dtype=dtype, tensor_parallel_size=tp)


def test_llama3_8b_bf16_by_hand():
    # 32 layers x 2 (K, V) x 8 heads x 128 dims x 2 bytes
    assert llama3_8b("bfloat16").bytes_per_token == 131072
    assert llama3_8b("float16").bytes_per_token == 131072
    assert llama3_8b("float32").bytes_per_token == 262144


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_llama3_8b_quantized_by_hand(dtype):
    # 65536 bytes of 1-byte values + one float32 scale per (layer, K/V, head): 32 x 2 x 8 x 4 = 2048
    spec = llama3_8b(dtype)
    assert spec.quantized
    assert spec.bytes_per_token == 65536 + 2048 == 67584
    assert spec.bytes_per_block == 67584 * 16


def test_bytes_per_block_is_block_size_tokens():
    assert llama3_8b("bfloat16", block_size=16).bytes_per_block == 2 * 1024 * 1024
    assert llama3_8b("bfloat16", block_size=32).bytes_per_block == 4 * 1024 * 1024


def test_gqa_stores_only_kv_heads():
    # the same model with full multi-head attention would store 4x as much
    mha = KVCacheSpec(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype="bfloat16")
    assert mha.bytes_per_token == 4 * llama3_8b("bfloat16").bytes_per_token
    # Qwen2.5-0.5B: 24 layers x 2 x 2 KV heads (of 14) x 64 dims x 2 bytes
    qwen = KVCacheSpec(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    assert qwen.bytes_per_token == 12288


@pytest.mark.parametrize("tp, heads_per_gpu", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_tensor_parallel_splits_kv_heads(tp, heads_per_gpu):
    spec = llama3_8b("bfloat16", tp=tp)
    assert spec.num_kv_heads == heads_per_gpu
    assert spec.bytes_per_token == 131072 // tp


@pytest.mark.parametrize("tp", [16, 32])
def test_tensor_parallel_replicates_when_fewer_kv_heads_than_ranks(tp):
    spec = llama3_8b("bfloat16", tp=tp)
    assert spec.num_kv_heads == 1
    assert spec.bytes_per_token == 131072 // 8


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError):
        llama3_8b("bfloat16", tp=0)


def test_blocks_round():
    spec = llama3_8b("bfloat16")
    assert spec.num_blocks_for(spec.bytes_per_block * 3 - 1) == 2
    assert spec.num_blocks_for(-5) == 0
    assert spec.blocks_for_tokens(8192) == 512
    assert spec.blocks_for_tokens(8193) == 513


@pytest.mark.parametrize("given_, model, expected", [
    ("auto", "bfloat16", "bfloat16"), ("auto", "float16", "float16"), ("fp8", "bfloat16", "fp8"),
    ("fp8_e4m3", "bfloat16", "fp8"), ("int8", "float16", "int8"), ("bf16", "float32", "bfloat16"),
])
def test_resolve_kv_dtype(given_, model, expected):
    assert resolve_kv_dtype(given_, model) == expected


def test_resolve_kv_dtype_rejects_unknown():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_dtype("fp4", "bfloat16")


def test_spec_rejects_bad_shapes():
    with pytest.raises(ValueError):
        KVCacheSpec(num_layers=0, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    with pytest.raises(ValueError):
        KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="fp4")


@given(layers=st.integers(1, 128), kv_heads=st.sampled_from([1, 2, 4, 8, 16, 32]),
       head_dim=st.sampled_from([32, 64, 80, 128, 256]), block=st.sampled_from([1, 8, 16, 32]))
def test_formula_properties(layers, kv_heads, head_dim, block):
    def spec(dtype: str, tp: int = 1) -> KVCacheSpec:
        return KVCacheSpec.for_model(layers, kv_heads, head_dim, block, dtype, tp)

    bf16, fp8, int8 = spec("bfloat16"), spec("fp8"), spec("int8")
    assert bf16.bytes_per_token == layers * 2 * kv_heads * head_dim * 2
    assert fp8.bytes_per_token == int8.bytes_per_token == layers * 2 * kv_heads * (head_dim + SCALE_BYTES)
    assert fp8.bytes_per_token * 2 - bf16.bytes_per_token == layers * 2 * kv_heads * 2 * SCALE_BYTES
    for tp in (1, 2, 4, 8):
        per_gpu = spec("bfloat16", tp)
        # ranks together never hold less than the whole cache; exactly the whole when heads split evenly
        assert per_gpu.num_kv_heads * tp >= kv_heads
        if kv_heads % tp == 0:
            assert per_gpu.bytes_per_token * tp == bf16.bytes_per_token
