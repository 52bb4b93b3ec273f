"""Compile the decode step's kernels for an H100 (sm_90) with programmatic dependent launch, on a
machine without a GPU: Triton's bundled ptxas needs no driver. Run in a process of its own,
without TRITON_INTERPRET (under the interpreter the kernels are not JITFunctions):

    python -m tests.kernels.sm90_compile            -> one JSON line per kernel variant
    python -m tests.kernels.sm90_compile --stats    -> registers, spills and the instructions of
        the main loop of the decode kernel (Llama-3-8B heads, batch 64, 4,096 tokens) per page dtype

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

from kernels import (cache_write, fp8, fused, gate_up, int4, int4_wgmma, linear, paged_attention,  # noqa: E402
                     prefill_ws)
from kernels.launch import TensorDescriptor  # noqa: E402

if prefill_ws.gluon is not None:
    from triton.experimental.gluon._runtime import GluonASTSource
    GluonDescriptor = prefill_ws.GluonDescriptor
else:
    GluonASTSource = GluonDescriptor = None

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
          torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg", "enable_fp_fusion")
GPU_SETTINGS = {"PDL": True, "NATIVE": True, "LINES": 16}


def _record(calls: list):
    def launch(fn, grid, *args, **kwargs):
        calls.append((fn, args, kwargs))
    return launch


def compile_sm90(fn, args: tuple, kwargs: dict, settings: dict = GPU_SETTINGS):
    """Triton's compiled kernel for an H100 from one recorded launch, constexprs overridden by
    `settings` where the kernel has them."""
    names = [p.name for p in fn.params]
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    values.update({k: v for k, v in settings.items() if k in names})
    signature, constexprs, attrs = {}, {}, {}
    # Triton's own specialization: 16-byte aligned tensors and integers divisible by 16 are
    # marked so (vectorized loads depend on it), integers equal to 1 become constants
    for i, p in enumerate(fn.params):
        v = values[p.name]
        if p.is_constexpr or (type(v) is int and v == 1 and not p.do_not_specialize):
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
            continue
        if GluonDescriptor is not None and isinstance(v, GluonDescriptor):
            signature[p.name] = f"tensordesc<{_TYPES[v.base.dtype]}{list(v.block_shape)},{v.layout!r}>"
            continue
        if TensorDescriptor is not None and isinstance(v, TensorDescriptor):
            signature[p.name] = f"tensordesc<{_TYPES[v.base.dtype]}{list(v.block_shape)}>"
            continue
        if isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TYPES[v.dtype]
            aligned = v.data_ptr() % 16 == 0 and not p.do_not_specialize_on_alignment
        elif isinstance(v, bool):
            signature[p.name], aligned = "i1", False
        elif isinstance(v, int):
            signature[p.name] = "i32" if -(1 << 31) <= v < (1 << 31) else "i64"
            aligned = v % 16 == 0 and not p.do_not_specialize
        else:
            signature[p.name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS} | {"launch_pdl": bool(values.get("PDL"))}
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    return triton.compile(source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 64), options=options)


def _check(fn, args: tuple, kwargs: dict) -> dict:
    compiled = compile_sm90(fn, args, kwargs)
    ptx = compiled.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    writes = [i for i in (ptx.find(op) for op in ("st.global", "atom.global", "red.global")) if i >= 0]
    first_access = min([i for i in [ptx.find("ld.global")] + writes if i >= 0], default=-1)
    return {"kernel": fn.__name__, "launch_pdl": bool(compiled.metadata.launch_pdl), "wait": wait >= 0,
            "launch_dependents": "griddepcontrol.launch_dependents" in ptx,
            "memory_after_wait": 0 <= wait < first_access, "prefetch_before_wait": 0 <= ptx.find("prefetch.global.L2") < wait,
            "writes_after_wait": 0 <= wait < min(writes, default=len(ptx))}


def cases() -> list[tuple]:
    """(fn, args, kwargs) of one launch of each wrapper the decode step calls."""
    calls: list = []
    rec = _record(calls)
    for mod in (linear, fused, gate_up, cache_write, paged_attention, fp8, int4):
        mod.launch = rec
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(64, 896, generator=g).to(bf)
    linear.skinny_linear(x, torch.randn(1152, 896, generator=g).to(bf), torch.randn(1152, generator=g).to(bf))
    linear.skinny_linear(torch.randn(64, 4864, generator=g).to(bf), torch.randn(896, 4864, generator=g).to(bf))
    fused.rms_norm(x, torch.randn(896, generator=g).to(bf), 1e-6, x.clone())
    # a 4-bit weight's activation order: the norm writes its output in it; o's input is gathered
    fused.rms_norm(x, torch.randn(896, generator=g).to(bf), 1e-6, x.clone(), order=torch.randperm(896, generator=g))
    fused.gather_columns(x, torch.randperm(896, generator=g))
    fused.silu_and_mul(torch.randn(64, 2 * 4864, generator=g).to(bf))
    # FP8 weights (kernels/fp8.py): the input's quantization and the FP8 GEMM, per-channel and block scales
    w8 = torch.randn(1152, 896, generator=g).to(torch.float8_e4m3fn)
    fp8.fp8_linear(x, w8, torch.ones(1152, 1))
    fp8.fp8_linear(x, w8, torch.ones(9, 7))
    fp8.quantize(torch.randn(4, 28672, generator=g).to(bf), 28672)  # a row longer than one read
    # 4-bit weights (kernels/int4.py): decode's W4A16 GEMM (groups of 128, and one group a row), and
    # the dequantization that prompts' steps take before cuBLAS
    w4 = torch.randint(-2**31, 2**31 - 1, (1152, 112), generator=g, dtype=torch.int32)
    for groups in (7, 1):
        int4.int4_linear(x, w4, torch.ones(groups, 1152, dtype=torch.float16),
                         torch.full((groups, 1152), 8, dtype=torch.uint8))
    int4.dequantize(w4, torch.ones(7, 1152, dtype=torch.float16), torch.full((7, 1152), 8, dtype=torch.uint8), bf)
    # Hopper's W4A16 kernel (Gluon): groups of 128 and of 32, K split, 128-row tiles
    if int4_wgmma.gluon is not None:
        for groups, dtype, block_m in ((7, bf, 64), (28, torch.float16, 64), (7, bf, 128)):
            grid, args, kwargs = int4_wgmma.launch_args(
                x.to(dtype), w4, torch.ones(groups, 1152, dtype=torch.float16),
                torch.full((groups, 1152), 8, dtype=torch.uint8), 896 // groups, None,
                torch.empty(64, 1152, dtype=dtype), int4_wgmma.Plan(block_m, 2), pdl=True)
            calls.append((int4_wgmma._w4a16_wgmma_kernel, args, kwargs))
    # the fused gate/up kernel after a cross-GPU sum (prefetch: with PDL)
    gate_up.gate_up_silu(x, torch.randn(2 * 4864, 896, generator=g).to(bf), prefetch=True)
    q = torch.randn(64, 14, 64, generator=g).to(bf)
    k = torch.randn(64, 2, 64, generator=g).to(bf)
    kc = torch.zeros(32, 2, 16, 64, dtype=bf)
    slots = torch.arange(64)
    fused.apply_rotary(q, k, torch.arange(64), torch.randn(128, 2, 64, generator=g), k.clone(), kc, kc.clone(), slots)
    ks = torch.ones(32, 2, 16)
    vt = kc.transpose(2, 3).contiguous()  # quantized V pages are [.., head_dim, block_size]
    for kv_dtype, storage in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        cache_write.write_kv_cache(k, k.clone(), kc.to(storage), vt.to(storage), slots, ks, ks.clone(), kv_dtype, q=q)
    bt = torch.arange(64 * 8, dtype=torch.int32).view(64, 8) % 32
    sl = torch.full((64,), 100, dtype=torch.int32)
    e4m3 = torch.float8_e4m3fn
    for kc_, vc_, scales in ((kc, kc.clone(), (None, None)), (kc.to(e4m3), vt.to(e4m3), (ks, ks))):
        paged_attention.paged_decode_attention(q, kc_, vc_, bt, sl, 0.125, *scales, config={"num_splits": 2})
    paged_attention.rotary_decode_attention(q, k, k.clone(), torch.arange(64), torch.randn(128, 2, 64, generator=g),
                                            kc, kc.clone(), slots, bt, sl, 0.125, config={"num_splits": 2})
    return calls


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass_stats(compiled) -> dict:
    """Registers and stack per thread (cuobjdump), and the opcodes of the longest loop body."""
    import collections
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    loop: collections.Counter = collections.Counter()
    for i, line in enumerate(lines):
        m = re.search(r"BRA.*`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:  # a backward branch closes a loop
            body = collections.Counter(op.group(1) for b in lines[labels[m.group(1)]:i + 1]
                                       if (op := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", b)))
            if sum(body.values()) > sum(loop.values()):
                loop = body
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    local = re.search(r"LOCAL:(\d+)", res)
    memory = {k: v for k, v in loop.items() if k.startswith(("LDG", "LDS", "STS", "LDL", "STL", "HMMA", "F2FP"))}
    return {"registers": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "local": int(local.group(1)) if local else None,
            "loop_instructions": sum(loop.values()), "loop_memory_and_mma": memory}


def decode_stats() -> list[dict]:
    calls: list = []
    paged_attention.launch = _record(calls)
    B, Hq, Hkv, D, bs, blocks = 64, 32, 8, 128, 16, 256
    q = torch.randn(B, Hq, D).to(torch.bfloat16)
    bt = torch.arange(B * blocks, dtype=torch.int32).view(B, blocks)
    sl = torch.full((B,), blocks * bs, dtype=torch.int32)
    ks = torch.ones(B * blocks, Hkv, bs)
    rows = []
    for kv, dt in ((None, torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        kc = torch.zeros(B * blocks, Hkv, bs, D).to(dt)
        vc = kc.transpose(2, 3).contiguous() if kv else kc.clone()
        paged_attention.paged_decode_attention(q, kc, vc, bt, sl, 0.1, *((ks, ks) if kv else (None, None)))
        fn, args, kwargs = calls[-1]
        plan = {k: kwargs[k] for k in ("TILE_N", "NUM_SPLITS", "PREFETCH", "num_warps", "num_stages")}
        rows.append({"kv": kv or "bf16", "plan": plan} | sass_stats(compile_sm90(fn, args, kwargs, {"NATIVE": True})))
    return rows


def compile_prefill_ws(head_dim: int, dtype: torch.dtype, Hq: int = 32, Hkv: int = 8, T: int = 256, bs: int = 16,
                       work: bool = False):
    """kernels/prefill_ws.py's Gluon kernel for an H100, from its wrapper's own launch arguments."""
    q = torch.randn(T, Hq, head_dim, dtype=dtype)
    k, v = torch.randn(T, Hkv, head_dim, dtype=dtype), torch.randn(T, Hkv, head_dim, dtype=dtype)
    kc = torch.randn(2 * T // bs, Hkv, bs, head_dim, dtype=dtype)
    bt = torch.arange(2 * T // bs, dtype=torch.int32)[None]
    sl, qsl = torch.tensor([2 * T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)
    w = torch.zeros(8, dtype=torch.int32) if work else None
    _, args, kwargs = prefill_ws.ws_launch_args(q, k, v, kc, kc.clone(), bt, sl, qsl, torch.empty_like(q),
                                                head_dim ** -0.5, T, w)
    return compile_sm90(prefill_ws._prefill_ws_kernel, args, kwargs)


def prefill_ws_stats() -> list[dict]:
    rows = []
    for head_dim, dtype, bs, work in ((64, torch.bfloat16, 16, False), (128, torch.bfloat16, 16, True),
                                      (128, torch.float16, 64, False)):
        compiled = compile_prefill_ws(head_dim, dtype, bs=bs, work=work)
        ptx = compiled.asm["ptx"]
        local = sass_stats(compiled)["local"]
        rows.append({"kernel": "_prefill_ws_kernel", "head_dim": head_dim, "dtype": _TYPES[dtype], "block_size": bs,
                     "work": work,
                     "local_bytes": local, "shared_bytes": compiled.metadata.shared,
                     "warpgroup_mma": "wgmma.mma_async" in ptx, "tma_loads": "cp.async.bulk.tensor" in ptx,
                     "setmaxnreg": "setmaxnreg" in ptx})
    return rows


def main() -> int:
    if "--prefill-ws" in sys.argv:
        for row in prefill_ws_stats():
            print(json.dumps(row), flush=True)
        return 0
    if "--stats" in sys.argv:
        for row in decode_stats():
            print(json.dumps(row), flush=True)
        return 0
    for fn, args, kwargs in cases():
        print(json.dumps(_check(fn, args, kwargs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
