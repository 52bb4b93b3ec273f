"""The roofline bound of a serving workload: how fast this GPU could serve it at best.

Prefill is compute bound: its time is the FLOPs of every prompt token over the matmul rate.
Decode is memory bound: each step reads every weight once, plus the KV cache of every running
sequence at its current context (the new token's K/V written counts as one more position), over
the copy bandwidth measured as bytes read + written. The first output token of a request comes
from its prefill, so a request of O output tokens takes O - 1 decode steps, the k-th at context
prompt + k. With C concurrent sequences a finished sequence's slot is taken by the next request
at the next step. bound = output tokens / (prefill time + decode time): the two phases are not
overlapped, and nothing is assumed cached (no prefix caching of a shared prefix).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from engine.config import ModelConfig
from kvcache.spec import KVCacheSpec, resolve_kv_dtype


@dataclass(frozen=True)
class HardwareRates:
    copy_bandwidth: float  # bytes/s of a device-to-device copy, counting bytes read plus written
    matmul_flops: float  # FLOP/s of a large bf16 matmul

    def __post_init__(self) -> None:
        if not (self.copy_bandwidth > 0 and self.matmul_flops > 0):
            raise ValueError("copy bandwidth and matmul rate must be > 0")


@dataclass(frozen=True)
class ModelCost:
    """What one token costs: FLOPs from ModelConfig, bytes from ModelConfig and KVCacheSpec."""

    model: ModelConfig
    weight_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, model: ModelConfig, kv_cache_dtype: str = "auto") -> "ModelCost":
        spec = KVCacheSpec.for_model(model.num_layers, model.num_kv_heads, model.head_dim, block_size=16,
                                     dtype=resolve_kv_dtype(kv_cache_dtype, model.torch_dtype))
        return cls(model, model.weight_bytes(model.torch_dtype), spec.bytes_per_token)

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of a causal prefill of prompt_len tokens.

        Matmuls: 2 FLOPs per parameter per token (the usual 2N rule). It also counts the input
        embedding of an untied model, which ModelConfig.flops_per_token leaves out; the figures in
        ARCHITECTURE.md were computed with 2N, and the bound stays on the safe (lower) side.
        Attention: token p (1-based) attends over p positions; flops_per_token is linear in the
        context, so the sum over the prompt is prompt_len times its value at the mean context.
        """
        mean_context = (prompt_len + 1) / 2
        attention = self.model.flops_per_token(mean_context) - self.model.flops_per_token(0)
        return prompt_len * (2.0 * self.model.num_params() + attention)


@dataclass(frozen=True)
class RooflineEstimate:
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    offered_output_throughput: float | None = None  # output tok/s the arrival rate allows, if capped

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_throughput(self) -> float:
        """The bound, output tokens/s."""
        hw = self.output_tokens / self.total_s if self.total_s > 0 else float("inf")
        return hw if self.offered_output_throughput is None else min(hw, self.offered_output_throughput)

    @property
    def decode_step_s(self) -> float:
        """Mean time of one decode step at the bound (compare with the median TPOT)."""
        return self.decode_s / self.decode_steps if self.decode_steps else 0.0


def _decode_traffic(lengths: Sequence[tuple[int, int]], concurrency: int) -> tuple[int, int]:
    """(decode steps, sum over steps of the context positions read) for requests served in order
    with at most `concurrency` decoding at once."""
    queue = deque(lengths)
    active: list[list[int]] = []  # [context of the next step, decode steps left]
    steps = 0
    positions = 0
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
        for seq in active:
            seq[0] += d
            seq[1] -= d
        active = [seq for seq in active if seq[1] > 0]
    return steps, positions


def estimate(cost: ModelCost, lengths: Sequence[tuple[int, int]], rates: HardwareRates,
             concurrency: int | None = None, request_rate: float | None = None) -> RooflineEstimate:
    """The bound for requests of (prompt tokens, output tokens), at most `concurrency` at once
    (None: all of them). With a request_rate the bound is also capped by the output tokens/s that
    the arrivals offer."""
    if not lengths:
        raise ValueError("the workload has no requests")
    c = min(concurrency or len(lengths), len(lengths))
    prefill_flops = sum(cost.prefill_flops(p) for p, _ in lengths)
    steps, positions = _decode_traffic(lengths, c)
    decode_bytes = steps * cost.weight_bytes + positions * cost.kv_bytes_per_token
    output_tokens = sum(o for _, o in lengths)
    offered = None
    if request_rate is not None and request_rate != float("inf"):
        offered = request_rate * output_tokens / len(lengths)
    return RooflineEstimate(
        prompt_tokens=sum(p for p, _ in lengths),
        output_tokens=output_tokens,
        concurrency=c,
        prefill_s=prefill_flops / rates.matmul_flops,
        decode_s=decode_bytes / rates.copy_bandwidth,
        decode_steps=steps,
        offered_output_throughput=offered,
    )
