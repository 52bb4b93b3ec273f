"""Shared builders for the kernel tests: random pages, block tables, tolerances; compiling for an H100
in a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcache import quant

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


ROOT = Path(__file__).resolve().parents[2]


def run_outside_interpreter(args: list[str], timeout: int) -> str:
    """stdout of `python -W ignore ARGS` from the repository root without TRITON_INTERPRET (under the
    interpreter kernels are not JITFunctions, so Triton's own ptxas cannot build them for sm_90);
    asserts that it exited 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-W", "ignore", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def gpu(fn):
    """Real-shape test: marker `gpu`, skipped cleanly without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(fn))

KV_STORAGE = {None: None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
# relative Frobenius error allowed against the float32 reference, by output dtype
REL_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_cache(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
               kv: str | None, device=DEVICE, gen: torch.Generator | None = None):
    """Random pages (never zeros). Float caches hold dtype values; quantized ones hold quantize()d
    random data with its scales, per token and head, in the pool's layout (K's and V's scales as
    views of one tensor, kvcache/quant.py)."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    # mixed magnitudes across tokens so per-token scales differ
    mag = torch.rand(num_blocks, num_kv_heads, block_size, 1, generator=gen) * 3 + 0.05
    kf = torch.randn(shape, generator=gen) * mag
    vf = torch.randn(shape, generator=gen) * mag.flip(2)
    if kv is None:
        return kf.to(dtype).to(device), vf.to(dtype).to(device), None, None
    kq, ks = quant.quantize(kf, kv)
    vq, vs = quant.quantize(vf, kv)
    vq = quant.v_page_view(vq).contiguous()  # V pages [.., head_dim, block_size]
    return (kq.to(device), vq.to(device), *quant.paired_scales(ks.to(device), vs.to(device)))


def make_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, extra_cols: int = 1,
                      gen: torch.Generator | None = None, device=DEVICE) -> torch.Tensor:
    """Each sequence gets distinct random blocks; unused tail entries hold junk (never read)."""
    need = [-(-s // block_size) for s in seq_lens]
    cols = max(need) + extra_cols
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.randint(10**6, 10**7, (len(seq_lens), cols), generator=gen, dtype=torch.int32)
    bt[:, ::2] = -1
    used = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[used:used + n].int()
        used += n
    return bt.to(device)
