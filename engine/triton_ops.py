"""The GPU op set: the Triton kernels of kernels/ behind the same Ops interface as the reference."""
from __future__ import annotations

from engine.attention import Ops


def triton_ops() -> Ops:
    from kernels.cache_write import write_kv_cache
    from kernels.fused import apply_rotary, rms_norm, silu_and_mul
    from kernels.linear import linear
    from kernels.paged_attention import paged_decode_attention
    from kernels.prefill_attention import paged_prefill_attention

    return Ops(rms_norm=rms_norm, apply_rotary=apply_rotary, silu_and_mul=silu_and_mul,
               write_kv_cache=write_kv_cache, decode_attention=paged_decode_attention,
               prefill_attention=paged_prefill_attention, linear=linear, reuse=True)
