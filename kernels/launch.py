"""Launching Triton kernels without JITFunction.run's per-call bookkeeping.

`kernel[grid](...)` binds the arguments, specializes each of them, hashes a cache key, checks
globals and builds launch metadata before it reaches the compiled kernel's launcher: tens of
microseconds of Python per call. A CUDA-graph decode step pays it once, at capture; an eager step
(any step with a prefill chunk) pays it for every kernel of every layer (~8 x 32 for Llama-3-8B).
Eager steps measured 20-36 ms of host time on the H100 machine with the GPU waiting (bench/NOTES.md).

`launch(fn, grid, *args, **kwargs)` keeps, per kernel, the compiled kernels that the normal path
returned, under a key that is at least as fine as Triton's specialization (tensor dtype and 16-byte
alignment, integer == 1 / divisible by 16 / 32-bit range, constexpr values, launch options), and
calls the launcher directly when the key has been seen. A new key goes through `fn[grid]` (which
compiles if needed). Under the interpreter, with launch hooks installed (profilers), or for
arguments of a kind it does not know, every call takes the normal path. CHECK = True
(PAGEDSERVE_CHECK_LAUNCH=1, set by bench/gpu_suite.sh's tests) asks Triton for its kernel on
every fast launch and asserts it is the cached one.
"""
from __future__ import annotations

import os

import torch

try:  # triton >= 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover
    _knobs = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

CHECK = os.environ.get("PAGEDSERVE_CHECK_LAUNCH") == "1"
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_INT32 = (-(1 << 31), 1 << 31)


def _hooks_installed() -> bool:
    """Launch hooks (a profiler's) are set: a plain function, or a HookChain (triton >= 3.6's
    default, empty) that holds one."""
    if _knobs is None:
        return True
    rt = _knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


class _Kernel:
    """The launch state of one @triton.jit function."""

    def __init__(self, fn) -> None:
        self.fn = fn
        params = fn.params
        self.names = [p.name for p in params]
        self.name_set = frozenset(self.names)
        self.constexpr = [p.is_constexpr for p in params]
        self.nospec = [bool(p.do_not_specialize) for p in params]
        self.noalign = [bool(p.do_not_specialize_on_alignment) for p in params]
        self.compiled: dict[tuple, object] = {}
        self.fast_launches = 0

    def key(self, args: list) -> tuple | None:
        out = []
        for a, const, nospec, noalign in zip(args, self.constexpr, self.nospec, self.noalign):
            if const:
                out.append(a)
            elif isinstance(a, torch.Tensor):
                out.append((a.dtype, noalign or a.data_ptr() % 16 == 0))
            elif isinstance(a, bool):
                out.append(("b", a))
            elif isinstance(a, int):
                rng = _INT32[0] <= a < _INT32[1]
                out.append(("i", rng) if nospec else ("i", rng, a == 1, a % 16 == 0))
            elif isinstance(a, float):
                out.append("f")
            elif a is None:
                out.append(None)
            elif TensorDescriptor is not None and isinstance(a, TensorDescriptor):
                b = a.base
                out.append(("d", b.dtype, tuple(a.block_shape), b.data_ptr() % 16 == 0,
                            tuple(s % 16 == 0 for s in a.strides), tuple(s % 16 == 0 for s in a.shape)))
            else:
                return None  # a kind this key does not cover: the normal path decides
        return tuple(out)


_KERNELS: dict[object, _Kernel] = {}


# triton.next_power_of_2 and triton.cdiv are constexpr-function wrappers in recent Triton: ~7 us a
# call on the host, and launch wrappers call several per kernel.
def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch(fn, grid: tuple[int, ...], *args, **kwargs) -> None:
    """fn[grid](*args, **kwargs), faster when this specialization was launched before. Every
    parameter must be given (positionally, or by name), launch options (num_warps, ...) by name."""
    k = _KERNELS.get(fn)
    if k is None:
        if not hasattr(fn, "params") or os.environ.get("TRITON_INTERPRET") == "1":
            fn[grid](*args, **kwargs)
            return
        k = _KERNELS[fn] = _Kernel(fn)
    names = k.names
    if len(args) < len(names):
        try:
            full = list(args) + [kwargs[n] for n in names[len(args):]]
        except KeyError:
            fn[grid](*args, **kwargs)  # a defaulted parameter: not worth a fast path
            return
        options = tuple(sorted((n, v) for n, v in kwargs.items() if n not in k.name_set))
    else:
        full = list(args)
        options = tuple(sorted(kwargs.items()))
    key = k.key(full)
    if key is None or _raw_stream is None or _hooks_installed():
        fn[grid](*args, **kwargs)
        return
    device = _current_device()
    key = key + options + (device,)
    kernel = k.compiled.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **kwargs)
        if kernel is not None:
            k.compiled[key] = kernel
        return
    if CHECK:
        expect = fn.run(*args, grid=grid, warmup=True, **kwargs)
        assert expect is kernel, f"{fn.__name__}: the launch key {key} maps to another compiled kernel"
    k.fast_launches += 1
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = _raw_stream(device)  # what Triton's own launch asks for; torch.cuda.current_stream() costs ~10 us
    kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *full)


def stats() -> dict[str, tuple[int, int]]:
    """Per kernel name: (specializations seen, launches that took the fast path)."""
    return {k.fn.__name__: (len(k.compiled), k.fast_launches) for k in _KERNELS.values()}
