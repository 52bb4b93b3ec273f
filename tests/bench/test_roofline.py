"""The roofline model against the H100 figures of ARCHITECTURE.md (3.01 TB/s, 810 TFLOP/s,
64 sequences x (512 prompt, 128 output))."""
from __future__ import annotations

import pytest

from bench.hardware import measure
from bench.presets import resolve_model
from bench.roofline import HardwareRates, ModelCost, estimate
from engine.config import ModelConfig

H100 = HardwareRates(copy_bandwidth=3.01e12, matmul_flops=810e12)
WORKLOAD = [(512, 128)] * 64


def cost(preset: str, kv: str = "auto") -> ModelCost:
    return ModelCost.of(ModelConfig.from_path(resolve_model(preset)), kv)


@pytest.mark.parametrize("preset,figure", [("llama3-8b", 5299), ("qwen2.5-0.5b", 80527)])
def test_matches_architecture_figures(preset, figure):
    est = estimate(cost(preset), WORKLOAD, H100, concurrency=64)
    assert est.output_throughput == pytest.approx(figure, rel=0.02)
    assert est.decode_steps == 127  # the first token of each request comes from its prefill
    assert est.output_tokens == 64 * 128 and est.prompt_tokens == 64 * 512


def test_decode_step_time_llama():
    c = cost("llama3-8b")
    est = estimate(c, WORKLOAD, H100, concurrency=64)
    # weights once + 64 sequences' KV at a mean context of 576 positions, over the copy bandwidth
    expected = (c.weight_bytes + 64 * 576 * c.kv_bytes_per_token) / H100.copy_bandwidth
    assert est.decode_step_s == pytest.approx(expected, rel=1e-9)
    assert est.decode_step_s == pytest.approx(6.94e-3, rel=0.01)


def test_uses_the_shared_sizing():
    c = cost("llama3-8b")
    assert c.weight_bytes == 2 * c.model.num_params()
    assert c.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # layers * K,V * kv heads * head dim * bf16
    assert cost("llama3-8b", "fp8").kv_bytes_per_token < c.kv_bytes_per_token


def test_concurrency_and_waves():
    c = cost("qwen2.5-0.5b")
    wide = estimate(c, WORKLOAD, H100, concurrency=64)
    narrow = estimate(c, WORKLOAD, H100, concurrency=8)
    assert narrow.decode_steps == 8 * 127  # 8 waves of 8
    assert narrow.output_throughput < wide.output_throughput
    assert estimate(c, WORKLOAD, H100, concurrency=None).decode_steps == 127
    # a request of one output token needs no decode step
    assert estimate(c, [(16, 1)], H100).decode_steps == 0


def test_request_rate_caps_the_bound():
    c = cost("qwen2.5-0.5b")
    est = estimate(c, WORKLOAD, H100, request_rate=2.0)
    assert est.output_throughput == pytest.approx(2.0 * 128)


def test_no_cuda_measures_nothing():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    m = measure()
    assert m.rates() is None and m.device is None
