"""Compile the decode step's kernels for an H100 (sm_90) with programmatic dependent launch, on a
machine without a GPU: Triton's bundled ptxas needs no driver. Run in a process of its own,
without TRITON_INTERPRET (under the interpreter the kernels are not JITFunctions):

    python -m tests.kernels.sm90_compile    -> one JSON line per kernel variant

Each kernel wrapper runs on small CPU tensors with its `launch` replaced by a recorder; the
recorded arguments are compiled with the GPU's settings (tensor cores, PDL) and the PTX is checked
for the grid-dependency wait (and, in the matmul, the weight prefetch).
"""
from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import cache_write, fused, linear, paged_attention  # noqa: E402

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
          torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
GPU_SETTINGS = {"PDL": True, "NATIVE": True, "LINES": 16}


def _record(calls: list):
    def launch(fn, grid, *args, **kwargs):
        calls.append((fn, args, kwargs))
    return launch


def _compile(fn, args: tuple, kwargs: dict) -> dict:
    names = [p.name for p in fn.params]
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    values.update({k: v for k, v in GPU_SETTINGS.items() if k in names})
    signature, constexprs = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -(1 << 31) <= v < (1 << 31) else "i64"
        else:
            signature[p.name] = "fp32"
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS} | {"launch_pdl": True}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 64), options=options)
    ptx = compiled.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    first_access = min((i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.global", "red.global"))
                        if i >= 0), default=-1)
    return {"kernel": fn.__name__, "launch_pdl": bool(compiled.metadata.launch_pdl), "wait": wait >= 0,
            "launch_dependents": "griddepcontrol.launch_dependents" in ptx,
            "memory_after_wait": 0 <= wait < first_access, "prefetch_before_wait": 0 <= ptx.find("prefetch.global.L2") < wait}


def cases() -> list[tuple]:
    """(fn, args, kwargs) of one launch of each wrapper the decode step calls."""
    calls: list = []
    rec = _record(calls)
    for mod in (linear, fused, cache_write, paged_attention):
        mod.launch = rec
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(64, 896, generator=g).to(bf)
    linear.skinny_linear(x, torch.randn(1152, 896, generator=g).to(bf), torch.randn(1152, generator=g).to(bf))
    linear.skinny_linear(torch.randn(64, 4864, generator=g).to(bf), torch.randn(896, 4864, generator=g).to(bf))
    fused.rms_norm(x, torch.randn(896, generator=g).to(bf), 1e-6, x.clone())
    fused.silu_and_mul(torch.randn(64, 2 * 4864, generator=g).to(bf))
    q = torch.randn(64, 14, 64, generator=g).to(bf)
    k = torch.randn(64, 2, 64, generator=g).to(bf)
    kc = torch.zeros(32, 2, 16, 64, dtype=bf)
    slots = torch.arange(64)
    fused.apply_rotary(q, k, torch.arange(64), torch.randn(128, 2, 64, generator=g), k.clone(), kc, kc.clone(), slots)
    ks = torch.ones(32, 2, 16)
    for kv_dtype, storage in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        cache_write.write_kv_cache(k, k.clone(), kc.to(storage), kc.to(storage), slots, ks, ks.clone(), kv_dtype, q=q)
    bt = torch.arange(64 * 8, dtype=torch.int32).view(64, 8) % 32
    sl = torch.full((64,), 100, dtype=torch.int32)
    for cache, scales in ((kc, (None, None)), (kc.to(torch.float8_e4m3fn), (ks, ks))):
        paged_attention.paged_decode_attention(q, cache, cache, bt, sl, 0.125, *scales, config={"num_splits": 2})
    return calls


def main() -> int:
    for fn, args, kwargs in cases():
        print(json.dumps(_compile(fn, args, kwargs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
