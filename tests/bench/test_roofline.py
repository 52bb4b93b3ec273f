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
def test_serial_bound(preset, figure):
    est = estimate(cost(preset), WORKLOAD, H100, concurrency=64)
    assert est.serial_output_throughput == pytest.approx(figure, rel=0.02)
    assert est.serial_s == pytest.approx(est.prefill_s + est.decode_s)
    assert est.decode_steps == 127  # the first token of each request comes from its prefill
    assert est.output_tokens == 64 * 128 and est.prompt_tokens == 64 * 512


# ARCHITECTURE.md's table (vocabulary 49,152, 3.01 TB/s, ~800 TFLOP/s): serial and physical bounds
@pytest.mark.parametrize("preset,concurrency,serial,physical", [
    ("llama3-8b", 64, 5672, 9908), ("llama3-8b", 256, 8270, 10637), ("qwen2.5-0.5b", 64, 94015, 154478)])
def test_physical_bound_matches_architecture_figures(preset, concurrency, serial, physical):
    cfg = dict(ModelConfig.from_path(resolve_model(preset)).raw, vocab_size=49152)
    c = ModelCost.of(ModelConfig.from_dict(cfg))
    est = estimate(c, [(512, 128)] * 3 * concurrency, HardwareRates(3.01e12, 800e12), concurrency=concurrency)
    assert est.serial_output_throughput == pytest.approx(serial, rel=0.03)
    assert est.output_throughput == pytest.approx(physical, rel=0.02)


def test_physical_bound_counts_every_flop_and_byte():
    c = cost("llama3-8b")
    est = estimate(c, WORKLOAD, H100, concurrency=64)
    n = c.model.num_params()
    positions = 64 * sum(512 + k for k in range(1, 128))  # decode k reads its context, the new token included
    flops = 64 * c.prefill_flops(512) + 64 * 127 * 2.0 * n + c.attention_flops(positions)
    nbytes = 127 * c.weight_bytes + positions * c.kv_bytes_per_token + 64 * 512 * c.kv_bytes_per_token
    assert est.compute_s == pytest.approx(flops / H100.matmul_flops, rel=1e-9)
    assert est.memory_s == pytest.approx(nbytes / H100.copy_bandwidth, rel=1e-9)
    assert est.output_throughput == pytest.approx(64 * 128 / max(est.compute_s, est.memory_s))
    # overlapping the phases can only help: the physical bound is at least the serial one, also
    # where decode is compute bound (a CPU's rates)
    assert est.output_throughput >= est.serial_output_throughput
    slow = estimate(c, WORKLOAD, HardwareRates(3.01e12, 1e11), concurrency=64)
    assert slow.output_throughput >= slow.serial_output_throughput


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
    assert est.serial_output_throughput == pytest.approx(2.0 * 128)


def test_no_cuda_measures_nothing():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    m = measure()
    assert m.rates() is None and m.device is None


def test_burst_rate_is_reported_beside_the_sustained_bound():
    from bench.hardware import Measurement
    from bench.report import Roofline

    c = cost("llama3-8b")
    rates = Measurement("GPU", 3.01e12, 660e12, matmul_flops_burst=800e12).rates()
    assert (rates.matmul_flops, rates.matmul_flops_burst) == (660e12, 800e12)
    est = estimate(c, WORKLOAD, rates, concurrency=64)
    cold = estimate(c, WORKLOAD, HardwareRates(3.01e12, 800e12), concurrency=64)
    # the bounds use the sustained rate; the burst rate only gives the fractions to compare with before
    assert est.serial_output_throughput < cold.serial_output_throughput
    assert est == estimate(c, WORKLOAD, HardwareRates(3.01e12, 660e12), concurrency=64)
    physical, serial = Roofline(est, rates, 1, cold).burst_fractions(1000.0)
    assert physical == pytest.approx(1000.0 / cold.output_throughput)
    assert serial == pytest.approx(1000.0 / cold.serial_output_throughput)
    assert Roofline(est, HardwareRates(3.01e12, 660e12), 1).burst_fractions(1000.0) is None


def test_fp8_weights_halve_the_projections_bytes_and_their_matmul_time():
    """--quantization fp8: the projections' weights one byte each, their matmuls at twice the rate
    (half their FLOPs against the 16-bit rate); embedding, LM head and KV unchanged."""
    from bench.cli import roofline_fp8

    model = ModelConfig.from_path(resolve_model("llama3-8b"))
    bf16, fp8 = ModelCost.of(model), ModelCost.of(model, fp8=True)
    p = model.projection_params()
    h, i, layers = model.hidden_size, model.intermediate_size, model.num_layers
    assert p == layers * (h * (model.q_size + 2 * model.kv_size) + model.q_size * h + 3 * h * i)
    assert bf16.weight_bytes - fp8.weight_bytes == p  # two bytes a weight -> one
    assert bf16.prefill_flops(512) - fp8.prefill_flops(512) == 512 * p
    assert bf16.decode_flops(64, 1000) - fp8.decode_flops(64, 1000) == 64 * p
    slow, fast = (estimate(c, WORKLOAD, H100, concurrency=64) for c in (bf16, fp8))
    assert fast.decode_step_s < 0.7 * slow.decode_step_s and fast.output_throughput > slow.output_throughput
    assert roofline_fp8(None, ["--quantization", "fp8"]) and roofline_fp8(None, ["-q", "fp8", "-tp", "2"])
    assert roofline_fp8("fp8", []) and not roofline_fp8(None, ["--kv-cache-dtype", "fp8"])
