"""Programmatic dependent launch (PDL; compute capability 9.0 and newer).

A kernel launched with `launch_pdl=True` may be started by the GPU while the kernel before it in
the stream is still running (in a CUDA graph the launch becomes a programmatic edge). Such a
kernel calls wait_for_prior() before it reads anything an earlier kernel wrote, and before it
writes anything (an earlier kernel may still read that memory: the allocator reuses freed
buffers). Before the wait it may only read what no kernel writes: weights. So the launch latency
and, for the matmuls, the weights' trip from HBM to L2 overlap the previous kernel, which is what
a decode step of a small model is made of (~220 kernels of 2-14 us for Qwen2.5-0.5B).

Every kernel that takes PDL calls wait_for_prior(PDL) first thing (after prefetching weights), and
then lets the next kernel launch. A kernel launched without the flag (cuBLAS, torch's own) is
ordered as usual. Under Triton's CPU interpreter PDL is always False (it has no such instructions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has finished and its writes are visible, then let
    the next kernel (if launched with PDL) start its own prologue."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding ptrs (one prefetch instruction per element, nothing
    loaded into registers). GPU only."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


def supported(device: torch.device) -> str | None:
    """None if kernels on `device` can be launched with PDL, else why not (one line)."""
    if device.type != "cuda":
        return f"programmatic dependent launch needs a CUDA GPU; the device is {device.type}"
    if not AVAILABLE:
        return f"programmatic dependent launch needs triton >= 3.4; this is {triton.__version__}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"programmatic dependent launch needs compute capability 9.0 or newer; this GPU has {major}.{minor}"
    return None
