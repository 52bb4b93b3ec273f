"""The GPUs' SM clock and power while a run is measured: nvidia-smi sampled beside the load.

An H100 held at its 700 W limit lowers its SM clock by 15-35% (bench/NOTES.md, 2026-11-27), so the
same engine serves compute-heavy steps slower on a warm, capped GPU than on a cold one. Each run's
result says how its GPUs ran: per GPU the median and lowest SM clock, the median power and the
share of samples in which nvidia-smi named the software power cap. Without nvidia-smi (a CPU
machine, a driver without the field) there is no summary, and nothing fails.
"""
from __future__ import annotations

import statistics
import subprocess
import tempfile
from collections import defaultdict

FIELDS = "index,clocks.sm,power.draw,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # nvidia-smi's clocks event reason bit: the software power cap


class GpuMonitor:
    """`with GpuMonitor() as m: ...` then `m.summary()`. active=False samples nothing (the GPUs
    that serve the run are not this machine's); command: the nvidia-smi to run."""

    def __init__(self, active: bool = True, interval_ms: int = 500, command: str = "nvidia-smi") -> None:
        self.active = active
        self.argv = [command, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", str(interval_ms)]
        self._proc: subprocess.Popen | None = None
        self._text = ""

    def __enter__(self) -> GpuMonitor:
        if not self.active:
            return self
        self._out = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a long run never blocks it
        try:
            self._proc = subprocess.Popen(self.argv, stdout=self._out, stderr=subprocess.DEVNULL,
                                          stdin=subprocess.DEVNULL)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if not self.active:
            return
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._out.seek(0)
        self._text = self._out.read()
        self._out.close()

    def summary(self) -> list[dict] | None:
        """Per GPU index: samples, sm_mhz_median, sm_mhz_min, power_w_median, power_capped_fraction;
        None where no sample was read."""
        return summarize(self._text)


def summarize(text: str) -> list[dict] | None:
    """nvidia-smi's CSV lines (index, SM MHz, W, reasons as hex) -> the per-GPU summary."""
    by_gpu: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            by_gpu[int(parts[0])].append((float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except ValueError:  # "[N/A]", a header, an error line
            continue
    if not by_gpu:
        return None
    out = []
    for index, samples in sorted(by_gpu.items()):
        clocks = [s[0] for s in samples]
        out.append({"index": index, "samples": len(samples), "sm_mhz_median": statistics.median(clocks),
                    "sm_mhz_min": min(clocks), "power_w_median": round(statistics.median(s[1] for s in samples), 1),
                    "power_capped_fraction": round(sum(1 for s in samples if s[2] & SW_POWER_CAP) / len(samples), 3)})
    return out
