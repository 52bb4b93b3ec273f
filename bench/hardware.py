"""Measure this GPU's device-to-device copy bandwidth and bf16 matmul rate (the roofline's inputs).

The matmul rate is the one the GPU sustains: an H100 held at its 700 W power limit lowers its
clocks within about a second of back-to-back matmuls (1,980 MHz cold, 1,300-1,470 MHz at the limit;
nvidia-smi names the software power cap), and a served compute-heavy model runs its prompt steps
for many seconds at that limit (bench/NOTES.md, 2026-11-27). So the products are timed after
SETTLE_S seconds of them; the first products' rate, which a cold GPU reaches, is kept as
`matmul_flops_burst` for comparison with figures measured that way.

`python -m bench.hardware` prints the measurement as one JSON line; the load generator runs it in
a subprocess so that its own process never holds a CUDA context beside the server's.
On a machine without CUDA every figure is None.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from bench.roofline import HardwareRates

SETTLE_S = 3.0  # back-to-back products before the sustained rate is timed
SUSTAIN_S = 1.0  # how long the sustained rate is timed over


@dataclass(frozen=True)
class Measurement:
    device: str | None = None  # e.g. "NVIDIA H100 80GB HBM3"; None without CUDA
    copy_bandwidth: float | None = None  # bytes/s, read + written
    matmul_flops: float | None = None  # FLOP/s, sustained (see the module's docstring)
    error: str | None = None  # why there are no figures, when CUDA was there but measuring failed
    matmul_flops_burst: float | None = None  # FLOP/s of the first products, on a cold GPU

    def rates(self) -> HardwareRates | None:
        if self.copy_bandwidth and self.matmul_flops:
            return HardwareRates(self.copy_bandwidth, self.matmul_flops, self.matmul_flops_burst)
        return None


def measure(copy_mib: int = 1024, matmul_n: int = 8192, warmup: int = 3, iters: int = 20) -> Measurement:
    import torch

    if not torch.cuda.is_available():
        return Measurement()
    device = torch.cuda.get_device_name()
    try:
        copy_bw = _copy_bandwidth(copy_mib, warmup, iters)
        flops, burst = _matmul_rates(matmul_n, warmup, iters)
    except torch.cuda.OutOfMemoryError as e:
        return Measurement(device=device, error=f"out of GPU memory while measuring: {e}".splitlines()[0])
    finally:
        torch.cuda.empty_cache()
    return Measurement(device=device, copy_bandwidth=copy_bw, matmul_flops=flops, matmul_flops_burst=burst)


def _copy_bandwidth(mib: int, warmup: int, iters: int) -> float:
    import torch

    src = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src), warmup, iters)
    return 2 * src.numel() * src.element_size() / seconds  # bytes read + bytes written


def _matmul_rates(n: int, warmup: int, iters: int, settle_s: float = SETTLE_S,
                  sustain_s: float = SUSTAIN_S) -> tuple[float, float]:
    """(sustained, burst) FLOP/s of an n x n x n bf16 product."""
    import torch

    # random data: an all-zero matmul runs measurably faster (and draws less power) than real weights
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    flops = 2.0 * n**3

    def product():
        return torch.matmul(a, b)
    burst = flops / _time_cuda(product, warmup, iters)
    start = time.monotonic()
    while time.monotonic() - start < settle_s:  # the GPU busy throughout: a few ms of queue at a time
        for _ in range(iters):
            product()
        torch.cuda.synchronize()
    sustained = flops / _time_cuda(product, 0, max(iters, int(sustain_s * burst / flops)))
    return sustained, burst


def _time_cuda(fn, warmup: int, iters: int) -> float:
    """Mean seconds per call, timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi, without loading CUDA; None when there is none."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
    return names[0].strip() if names else None


def measure_in_subprocess(timeout_s: float = 300.0) -> Measurement:
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.hardware"], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return Measurement(error=f"measuring the GPU took over {timeout_s:.0f} s")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Measurement(error=f"measuring the GPU failed: {last}")
    return Measurement(**json.loads(proc.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    print(json.dumps(asdict(measure())))
