"""The roofline bound of a serving workload: how fast this GPU could serve it at best.

Every step of a serving engine reads every weight once, whatever it carries, plus the KV cache of
every sequence it attends over; its matmuls cost 2 FLOPs per weight per token. A request of O
output tokens takes O - 1 decode steps (its first token comes from its prefill), the k-th at
context prompt + k; with C concurrent sequences a finished sequence's slot is taken by the next
request at the next step, so the workload needs at least `decode_steps` steps.

Physical bound (the headline): output tokens / max(all FLOPs / matmul rate, all bytes / copy
bandwidth), with the weights read once per decode step. A step that carries decode rows and
prompt tokens uses the memory system and the tensor cores at once, so the two phases overlap.
FLOPs: 2 per parameter per token, prompt and output tokens alike, plus attention over each
token's context. Bytes: the weights once per step, the KV read by each decode, and the KV written
for every token.

Serial bound: the prefill phase's time plus the decode phase's, each the larger of its FLOPs over
the matmul rate and its bytes over the copy bandwidth, as if the GPU ran the two phases one after
the other (on a GPU prefill is compute bound and decode memory bound). It is never above the
physical bound.

Mixtures of experts: a step reads the weights outside the experts once, and in each MoE layer
only the experts its tokens touch: with B tokens each picking k of E experts, E * (1 - (1 - k/E)^B)
of them in expectation (kvcache/calc.py expected_experts). FLOPs count the active parameters (k
experts per token).

Nothing is assumed cached (no prefix caching of a shared prefix).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Sequence

from engine.config import ModelConfig
from engine.quant import AT_LOAD, Fp8Format
from kvcache.calc import expected_experts, quant_saving
from kvcache.spec import DTYPE_BYTES, KVCacheSpec, resolve_kv_dtype


@dataclass(frozen=True)
class HardwareRates:
    copy_bandwidth: float  # bytes/s of a device-to-device copy, counting bytes read plus written
    matmul_flops: float  # FLOP/s of a large bf16 matmul, as the GPU sustains it (bench/hardware.py)
    matmul_flops_burst: float | None = None  # the same on a cold GPU, for comparison; no bound uses it

    def __post_init__(self) -> None:
        if not (self.copy_bandwidth > 0 and self.matmul_flops > 0):
            raise ValueError("copy bandwidth and matmul rate must be > 0")


@dataclass(frozen=True)
class ModelCost:
    """What one token costs: FLOPs from ModelConfig, bytes from ModelConfig and KVCacheSpec."""

    model: ModelConfig
    weight_bytes: int
    kv_bytes_per_token: int
    # weights held in FP8 (engine/quant.py): one byte each, and their matmuls at twice the 16-bit
    # rate (Hopper's FP8 tensor cores), counted below as half their FLOPs against that rate
    fp8_params: int = 0

    @classmethod
    def of(cls, model: ModelConfig, kv_cache_dtype: str = "auto", fp8: bool = False) -> "ModelCost":
        """fp8: the server quantizes the projections (--quantization fp8); an FP8 checkpoint is FP8 anyway."""
        spec = KVCacheSpec.for_model(model.num_layers, model.num_kv_heads, model.head_dim, block_size=16,
                                     dtype=resolve_kv_dtype(kv_cache_dtype, model.torch_dtype))
        if fp8 and model.quant is None:
            model = replace(model, quant=AT_LOAD)
        weight_bytes = model.weight_bytes(model.torch_dtype) - quant_saving(model, model.torch_dtype)
        # 4-bit weights multiply as 16-bit ones (kernels/int4.py)
        fp8_params = model.projection_params() if isinstance(model.quant, Fp8Format) else 0
        return cls(model, weight_bytes, spec.bytes_per_token, fp8_params)

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads: all of a dense model's; a mixture of
        experts' outside the experts plus, per MoE layer, the experts the tokens touch (expected)."""
        m = self.model
        if not m.num_experts:
            return float(self.weight_bytes)
        expert = m.expert_params * DTYPE_BYTES[m.torch_dtype]
        untouched = m.num_experts - expected_experts(m.num_experts, m.num_experts_per_tok, tokens)
        return self.weight_bytes - m.num_moe_layers * untouched * expert
    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of a causal prefill of prompt_len tokens.

        Matmuls: 2 FLOPs per parameter per token (the usual 2N rule). It also counts the input
        embedding of an untied model, which ModelConfig.flops_per_token leaves out; the figures in
        ARCHITECTURE.md were computed with 2N, and the bound stays on the safe (lower) side.
        Attention: token p (1-based) attends over p positions; flops_per_token is linear in the
        context, so the sum over the prompt is prompt_len times its value at the mean context.
        """
        mean_context = (prompt_len + 1) / 2
        return prompt_len * (2.0 * self.model.active_params() - self.fp8_params + self.attention_flops(mean_context))

    def attention_flops(self, context: float) -> float:
        """QK^T and PV of one token over `context` positions."""
        return self.model.flops_per_token(context) - self.model.flops_per_token(0)

    def decode_flops(self, tokens: int, positions: int) -> float:
        """FLOPs of `tokens` decode tokens attending over `positions` context positions in all."""
        return tokens * (2.0 * self.model.active_params() - self.fp8_params) + self.attention_flops(positions)


@dataclass(frozen=True)
class RooflineEstimate:
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    prefill_s: float  # the prefill phase alone at the bound (the serial bound's first phase)
    decode_s: float  # the decode phase alone (its second)
    decode_steps: int
    compute_s: float  # all FLOPs / matmul rate
    memory_s: float  # all bytes / copy bandwidth
    offered_output_throughput: float | None = None  # output tok/s the arrival rate allows, if capped

    @property
    def total_s(self) -> float:
        """The physical bound's time: compute and memory overlapped."""
        return max(self.compute_s, self.memory_s)

    @property
    def serial_s(self) -> float:
        return self.prefill_s + self.decode_s

    def _throughput(self, seconds: float) -> float:
        hw = self.output_tokens / seconds if seconds > 0 else float("inf")
        return hw if self.offered_output_throughput is None else min(hw, self.offered_output_throughput)

    @property
    def output_throughput(self) -> float:
        """The physical bound, output tokens/s."""
        return self._throughput(self.total_s)

    @property
    def serial_output_throughput(self) -> float:
        """The serial bound, output tokens/s."""
        return self._throughput(self.serial_s)

    @property
    def decode_step_s(self) -> float:
        """Mean time of one pure decode step at the bound (compare with the median TPOT)."""
        return self.decode_s / self.decode_steps if self.decode_steps else 0.0


def _decode_traffic(lengths: Sequence[tuple[int, int]], concurrency: int) -> tuple[int, int, Counter]:
    """(decode steps, sum over steps of the context positions read, steps by batch size) for
    requests served in order with at most `concurrency` decoding at once."""
    queue = deque(lengths)
    active: list[list[int]] = []  # [context of the next step, decode steps left]
    steps = 0
    positions = 0
    batches: Counter = Counter()
    while queue or active:
        while queue and len(active) < concurrency:
            prompt, output = queue.popleft()
            if output > 1:
                active.append([prompt + 1, output - 1])
        if not active:
            break
        # advance to the next finish in one go: the contexts grow by one per step
        d = min(left for _, left in active)
        n = len(active)
        positions += d * sum(ctx for ctx, _ in active) + n * d * (d - 1) // 2
        steps += d
        batches[n] += d
        for seq in active:
            seq[0] += d
            seq[1] -= d
        active = [seq for seq in active if seq[1] > 0]
    return steps, positions, batches


def estimate(cost: ModelCost, lengths: Sequence[tuple[int, int]], rates: HardwareRates,
             concurrency: int | None = None, request_rate: float | None = None) -> RooflineEstimate:
    """The bound for requests of (prompt tokens, output tokens), at most `concurrency` at once
    (None: all of them). With a request_rate the bound is also capped by the output tokens/s that
    the arrivals offer."""
    if not lengths:
        raise ValueError("the workload has no requests")
    c = min(concurrency or len(lengths), len(lengths))
    prefill_flops = sum(cost.prefill_flops(p) for p, _ in lengths)
    steps, positions, batches = _decode_traffic(lengths, c)
    weight_reads = sum(count * cost.step_weight_bytes(n) for n, count in batches.items())
    decode_bytes = weight_reads + positions * cost.kv_bytes_per_token
    output_tokens = sum(o for _, o in lengths)
    prompt_tokens = sum(p for p, _ in lengths)
    decode_tokens = sum(o - 1 for _, o in lengths if o > 1)
    decode_flops = cost.decode_flops(decode_tokens, positions)
    # the prompts' KV is written once; a workload of single-token outputs still reads the weights once
    prefill_bytes = prompt_tokens * cost.kv_bytes_per_token + (0 if steps else cost.weight_bytes)
    all_bytes = decode_bytes + prefill_bytes
    offered = None
    if request_rate is not None and request_rate != float("inf"):
        offered = request_rate * output_tokens / len(lengths)
    return RooflineEstimate(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        concurrency=c,
        prefill_s=max(prefill_flops / rates.matmul_flops, prefill_bytes / rates.copy_bandwidth),
        decode_s=max(decode_bytes / rates.copy_bandwidth, decode_flops / rates.matmul_flops),
        decode_steps=steps,
        compute_s=(prefill_flops + decode_flops) / rates.matmul_flops,
        memory_s=all_bytes / rates.copy_bandwidth,
        offered_output_throughput=offered,
    )
