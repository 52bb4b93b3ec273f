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
(PAGEDSERVE_CHECK_LAUNCH=1, set by lab/gpu_suite.sh's tests) asks Triton for its kernel on
every fast launch and asserts it is the cached one.

`compile_ahead()` makes a dry pass: inside it, a launch of a specialization not seen before is not
run; its compile goes to a pool of threads (Triton compiles run side by side on threads: 3.4x on
8 threads, measured) and the exit waits for them. Start-up runs each phase's forwards once this way,
then for real: a cold start compiled ~33 variants one after another for ~47 s (bench/NOTES.md).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

try:  # triton >= 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover
    _knobs = None
try:  # triton >= 3.4 (host-side TMA descriptors); the kernels' wrappers import it from here
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None
try:  # Gluon's host-side descriptors (kernels/prefill_ws.py)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # pragma: no cover
    GluonTensorDescriptor = None

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
            spec = _arg_key(a, const, nospec, noalign)
            if spec is _UNKNOWN:
                return None  # a kind this key does not cover: the normal path decides
            out.append(spec)
        return tuple(out)

    def arg_key(self, i: int, a) -> object:
        return _arg_key(a, self.constexpr[i], self.nospec[i], self.noalign[i])


_UNKNOWN = object()


def _arg_key(a, const: bool, nospec: bool, noalign: bool) -> object:
    """One argument's part of the launch key."""
    if const:
        return a
    if isinstance(a, torch.Tensor):
        return (a.dtype, noalign or a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        rng = _INT32[0] <= a < _INT32[1]
        return ("i", rng) if nospec else ("i", rng, a == 1, a % 16 == 0)
    if isinstance(a, float):
        return "f"
    if a is None:
        return None
    if TensorDescriptor is not None and isinstance(a, TensorDescriptor):
        b = a.base
        return ("d", b.dtype, tuple(a.block_shape), b.data_ptr() % 16 == 0,
                tuple(s % 16 == 0 for s in a.strides), tuple(s % 16 == 0 for s in a.shape))
    if GluonTensorDescriptor is not None and isinstance(a, GluonTensorDescriptor):
        b = a.base
        return ("gd", b.dtype, tuple(a.block_shape), a.layout, a.padding, b.data_ptr() % 16 == 0,
                tuple(s % 16 == 0 for s in a.strides), tuple(s % 16 == 0 for s in a.shape))
    return _UNKNOWN


_KERNELS: dict[object, _Kernel] = {}


# triton.next_power_of_2 and triton.cdiv are constexpr-function wrappers in recent Triton: ~7 us a
# call on the host, and launch wrappers call several per kernel.
def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_count(tiles: int, steps: int, programs: float, min_steps: int, most: int | None = None) -> int:
    """A matmul plan's K split: doubled from 1 while its `tiles` output tiles give fewer than
    `programs` programs, each program keeping at least `min_steps` of the K loop's `steps` (and the
    split at most `most`)."""
    split = 1
    while tiles * split < programs and (most is None or split < most) and steps // (split * 2) >= min_steps:
        split *= 2
    return split


class _Compiles:
    """The compiles that a compile_ahead() pass submitted, one per launch key, on its threads."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile")
        self.keys: set[tuple] = set()
        self.pending: dict[object, list[Future]] = {}  # kernel -> its compiles not yet waited for
        self.count = 0

    def submit(self, fn, grid: tuple[int, ...], args: tuple, kwargs: dict, key: tuple | None) -> None:
        if key is not None:
            if key in self.keys or any(key in c.keys for c in _BACKGROUND):
                return
            self.keys.add(key)
        self.count += 1
        future = self.pool.submit(self._compile, _current_device(), fn, grid, args, kwargs)
        self.pending.setdefault(fn, []).append(future)

    @staticmethod
    def _compile(device: int, fn, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        torch.cuda.set_device(device)  # a new thread starts on device 0; Triton caches per device
        fn.warmup(*args, grid=grid, **kwargs)

    def wait(self, fn) -> None:
        """fn's compiles done (its first launch then finds them in Triton's cache); raise a failure."""
        for f in self.pending.pop(fn, ()):
            f.result()

    def wait_all(self) -> None:
        try:
            for fn in list(self.pending):
                self.wait(fn)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


_DRY: ContextVar[_Compiles | None] = ContextVar("pagedserve_compile_ahead", default=None)
_BACKGROUND: list[_Compiles] = []  # passes left compiling (wait=False): a launch that misses waits for them


@contextmanager
def compile_ahead(threads: int | None = None, wait: bool = True) -> Iterator[list[int]]:
    """A dry pass: launches of specializations seen before run as usual; a new one is not run (its
    outputs keep whatever they held), and its compile is submitted to `threads` threads (default:
    the CPUs this process may use). Run inside it only forwards whose results nothing reads, then
    run them again for real. On exit, waits for every compile; with wait=False they go on in the
    background, and the first launch of a kernel waits for that kernel's compiles (finish_compiles()
    waits for all). Yields a list that holds, after the exit, the number of compiles submitted. Off
    (everything runs) under the interpreter, without a GPU, or nested."""
    count: list[int] = []
    if os.environ.get("TRITON_INTERPRET") == "1" or _DRY.get() is not None or not torch.cuda.is_available():
        yield count
        return
    compiles = _Compiles(threads or len(os.sched_getaffinity(0)))
    token = _DRY.set(compiles)
    try:
        yield count
    finally:
        _DRY.reset(token)
        count.append(compiles.count)
        if wait:
            compiles.wait_all()
        else:
            _BACKGROUND.append(compiles)


def finish_compiles() -> None:
    """Wait for every compile left in the background; raise the first failure."""
    while _BACKGROUND:
        _BACKGROUND.pop().wait_all()


def _compile_now(fn, grid: tuple[int, ...], args: tuple, kwargs: dict):
    """fn[grid](...) (in a dry pass: its compile submitted, nothing run), after any compile of fn
    left in the background."""
    dry = _DRY.get()
    if dry is not None:
        dry.submit(fn, grid, args, kwargs, None)
        return None
    for compiles in _BACKGROUND:
        compiles.wait(fn)
    return fn[grid](*args, **kwargs)


def launch(fn, grid: tuple[int, ...], *args, **kwargs) -> None:
    """fn[grid](*args, **kwargs), faster when this specialization was launched before. Every
    parameter must be given (positionally, or by name), launch options (num_warps, ...) by name."""
    _launch(fn, grid, args, kwargs)


def bind(fn, grid: tuple[int, ...], *args, **kwargs) -> "Bound | None":
    """launch(), and return a Bound that repeats it with some arguments replaced, or None where
    launches take the normal path (interpreter, profiler hooks, unknown argument kinds)."""
    return _launch(fn, grid, args, kwargs, keep=True)


class Bound:
    """A launch to repeat with other buffers (the same attention for every layer of a step): the
    compiled kernel, grid and arguments. A call replaces arguments by position; a replacement of
    another specialization (dtype, alignment, ...) goes through launch() instead of the kernel."""

    __slots__ = ("state", "fn", "kernel", "grid", "device", "args", "options")

    def __init__(self, state: _Kernel, kernel, grid: tuple[int, int, int], device: int, args: list,
                 options: dict) -> None:
        self.state, self.fn, self.kernel = state, state.fn, kernel
        self.grid, self.device, self.args, self.options = grid, device, args, options

    def __call__(self, changes: tuple[tuple[int, object], ...]) -> None:
        args = self.args.copy()
        state = self.state
        for i, new in changes:
            old = args[i]
            if new is old:  # the same object: nothing to check (a step's q, out, ... for every layer)
                continue
            if state.arg_key(i, new) != state.arg_key(i, old):
                for j, v in changes:
                    args[j] = v
                launch(self.fn, self.grid, *args, **self.options)
                return
            args[i] = new
        kernel = self.kernel
        g0, g1, g2 = self.grid
        if CHECK:
            expect = self.fn.run(*args, grid=self.grid, warmup=True, **self.options)
            assert expect is kernel, f"{self.fn.__name__}: a bound relaunch maps to another compiled kernel"
        kernel.run(g0, g1, g2, _raw_stream(self.device), kernel.function, kernel.packed_metadata, None, None, None,
                   *args)


def _launch(fn, grid: tuple[int, ...], args: tuple, kwargs: dict, keep: bool = False) -> Bound | None:
    k = _KERNELS.get(fn)
    if k is None:
        if not hasattr(fn, "params") or os.environ.get("TRITON_INTERPRET") == "1":
            _compile_now(fn, grid, args, kwargs)
            return None
        k = _KERNELS[fn] = _Kernel(fn)
    names = k.names
    if len(args) < len(names):
        try:
            full = list(args) + [kwargs[n] for n in names[len(args):]]
        except KeyError:
            _compile_now(fn, grid, args, kwargs)  # a defaulted parameter: not worth a fast path
            return None
        options = tuple(sorted((n, v) for n, v in kwargs.items() if n not in k.name_set))
    else:
        full = list(args)
        options = tuple(sorted(kwargs.items()))
    key = k.key(full)
    if key is None or _raw_stream is None or _hooks_installed():
        _compile_now(fn, grid, args, kwargs)
        return None
    device = _current_device()
    key = key + options + (device,)
    kernel = k.compiled.get(key)
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    if kernel is None:
        dry = _DRY.get()
        if dry is not None:
            dry.submit(fn, grid, args, kwargs, key)
            return None
        kernel = _compile_now(fn, grid, args, kwargs)
        if kernel is None:
            return None
        k.compiled[key] = kernel
    else:
        if CHECK:
            expect = fn.run(*args, grid=grid, warmup=True, **kwargs)
            assert expect is kernel, f"{fn.__name__}: the launch key {key} maps to another compiled kernel"
        k.fast_launches += 1
        stream = _raw_stream(device)  # what Triton's own launch asks for; torch.cuda.current_stream() costs ~10 us
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *full)
    if not keep:
        return None
    # in the caller's order: Triton's own cache key is the options' string (CHECK compares kernels)
    return Bound(k, kernel, (g0, g1, g2), device, full, {n: v for n, v in kwargs.items() if n not in k.name_set})


# Arrival counters of the kernels whose last program to finish does the final reduction (decode
# attention's split merge, the skinny matmul's split-K sum). Every such kernel sets the counters
# it used back to zero before it ends, and launches on a device are ordered (one stream), so all
# of them share one buffer per device. A captured CUDA graph holds the buffer's address: a grown
# buffer keeps the smaller ones alive.
_COUNTERS: dict[object, list[torch.Tensor]] = {}
MIN_COUNTERS = 8192


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters on device, zero between launches, allocated once and reused."""
    kept = _COUNTERS.get(device)
    if kept and kept[-1].numel() >= n:
        return kept[-1]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{n} arrival counters are needed while a CUDA graph is being captured; "
                           "run the same launch once eagerly before the capture")
    counters = torch.zeros(max(MIN_COUNTERS, next_pow2(n)), dtype=torch.int32, device=device)
    _COUNTERS.setdefault(device, []).append(counters)
    return counters


def separate_arrival_counters(device: torch.device) -> None:
    """Launches on device from now on take a new set of counters, the sets before staying alive for
    the graphs that hold them: for CUDA graphs that will run at the same time on two streams, which
    the shared set assumes away (each graph's launches planned after its own call of this)."""
    kept = _COUNTERS.setdefault(device, [])
    kept.append(torch.zeros(kept[-1].numel() if kept else MIN_COUNTERS, dtype=torch.int32, device=device))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The CUDA device's multiprocessors (asked once a device): persistent launches run one program each."""
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


def stats() -> dict[str, tuple[int, int]]:
    """Per kernel name: (specializations seen, launches that took the fast path)."""
    return {k.fn.__name__: (len(k.compiled), k.fast_launches) for k in _KERNELS.values()}
