"""The roofline of a mixture of experts: a decode step reads the experts its tokens touch (expected
count at the batch size), FLOPs follow the active parameters; kv-calc holds every expert."""
from __future__ import annotations

import pytest

from bench.presets import resolve_model
from bench.roofline import HardwareRates, ModelCost, estimate
from engine.config import ModelConfig
from kvcache.calc import expected_experts, plan, weight_bytes_per_gpu
from kvcache.gpus import GiB

H100 = HardwareRates(copy_bandwidth=3.01e12, matmul_flops=810e12)


def config(preset: str) -> ModelConfig:
    return ModelConfig.from_path(resolve_model(preset))


def test_expected_experts():
    assert expected_experts(128, 8, 1) == pytest.approx(8)
    assert expected_experts(128, 8, 2) == pytest.approx(8 + 8 * 120 / 128)  # the second token's new picks
    assert expected_experts(128, 8, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))  # 125.9
    assert expected_experts(8, 2, 1000) == pytest.approx(8)
    assert expected_experts(0, 0, 64) == 0.0


def test_step_weight_bytes_grow_from_the_active_to_all_parameters():
    m = config("qwen3-30b-a3b")
    assert (m.num_params(), m.active_params()) == (30_532_122_624, 3_353_032_704)  # Qwen3-30B-A3B, 3.3B active
    c = ModelCost.of(m)
    assert c.step_weight_bytes(1) == pytest.approx(2 * m.active_params())
    per_layer = 2 * m.expert_params * m.num_moe_layers
    assert c.step_weight_bytes(64) == pytest.approx(c.weight_bytes - per_layer * (128 - expected_experts(128, 8, 64)))
    assert c.step_weight_bytes(10**4) == pytest.approx(c.weight_bytes)
    dense = ModelCost.of(config("llama3-8b"))
    assert dense.step_weight_bytes(1) == dense.step_weight_bytes(256) == dense.weight_bytes


def test_flops_count_the_active_parameters():
    m = config("mixtral-8x7b")
    c = ModelCost.of(m)
    assert c.decode_flops(1, 0) == 2.0 * m.active_params()
    assert m.active_params() == pytest.approx(12.9e9, rel=0.01)  # Mixtral-8x7B: 2 of 8 experts


def test_decode_bound_reads_fewer_bytes_at_small_batches():
    c = ModelCost.of(config("qwen3-30b-a3b"))
    one = estimate(c, [(512, 128)], H100, concurrency=1)
    assert one.decode_s == pytest.approx(127 * (c.step_weight_bytes(1) + (512 + 64) * c.kv_bytes_per_token)
                                         / H100.copy_bandwidth, rel=1e-3)
    wide = estimate(c, [(512, 128)] * 64, H100, concurrency=64)
    assert wide.decode_step_s > 5 * one.decode_step_s  # 126 of 128 experts touched vs 8


def test_kv_calc_counts_every_expert_and_fits_one_h100():
    m = config("qwen3-30b-a3b")
    assert weight_bytes_per_gpu(m, "bfloat16") == 2 * m.num_params()
    p = plan(m, 80 * 10**9, 0.9)  # H100 80GB, defaults
    assert p.weight_bytes / GiB == pytest.approx(56.9, abs=0.1)
    assert p.max_tokens > 64 * 640  # the 64 x (512 + 128) workload
    assert p.active_params == m.active_params() and 3.3e9 < p.active_params < 3.4e9  # Qwen's "A3B"
    assert plan(config("llama3-8b"), 80 * 10**9, 0.9).active_params is None  # dense: every parameter
    # two ranks hold half the experts each (or half of each), the router and norms whole
    mix = config("mixtral-8x7b")
    two = weight_bytes_per_gpu(mix, "bfloat16", 2)
    assert mix.num_params() < two < 1.01 * mix.num_params()
