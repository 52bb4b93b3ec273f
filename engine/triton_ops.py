"""The GPU op set: the Triton kernels of kernels/ behind the same Ops interface as the reference."""
from __future__ import annotations

from functools import partial

from engine.attention import Ops


def triton_ops(pdl: bool = False) -> Ops:
    """pdl: the kernels of a decode layer launch with programmatic dependent launch (kernels/pdl.py)."""
    from kernels.argmax import argmax_keys, argmax_rows
    from kernels.cache_write import write_kv_cache
    from kernels.fp8 import fp8_gate_up_silu, fp8_linear
    from kernels.fused import apply_rotary, rms_norm, silu_and_mul
    from kernels.gate_up import mlp_gate_up
    from kernels.int4 import int4_gate_up_silu, int4_linear
    from kernels.linear import linear
    from kernels.moe import fused_moe
    from kernels.paged_attention import paged_decode_attention, rotary_decode_attention
    from kernels.prefill_attention import paged_prefill_attention

    fns = dict(rms_norm=rms_norm, apply_rotary=apply_rotary, gate_up_silu=mlp_gate_up,
               write_kv_cache=write_kv_cache, decode_attention=paged_decode_attention,
               rotary_decode_attention=rotary_decode_attention, linear=linear, fp8_linear=fp8_linear,
               fp8_gate_up_silu=fp8_gate_up_silu, int4_linear=int4_linear, int4_gate_up_silu=int4_gate_up_silu,
               silu_and_mul=silu_and_mul)
    if pdl:  # prefill attention (compute bound, long) launches the usual way
        fns = {name: partial(fn, pdl=True) for name, fn in fns.items()}
    # argmax_rows launches without PDL: it follows the lm_head's cuBLAS GEMM
    return Ops(prefill_attention=paged_prefill_attention, argmax_rows=argmax_rows, reuse=True, work_lists=True,
               fused_moe=fused_moe, argmax_keys=argmax_keys, **fns)
