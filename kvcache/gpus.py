"""GPU memory sizes for `serve kv-calc`: named GPUs and the parsing of --gpu-memory into a byte count.

GPU presets hold the total memory CUDA reports (torch.cuda.mem_get_info()[1]): the number the
engine multiplies by the memory utilization. It is nvidia-smi's memory.total less the driver's
reserved memory (H100 80GB HBM3: 81559 - 480 MiB; H200: 143771 - 616 MiB, both measured with
driver 580). Where we have not measured a card, the preset holds nvidia-smi's memory.total, which
overstates CUDA's figure by a few hundred MiB (under 1% of the cache); pass a size to be exact.
Measured cards also hold their copy bandwidth and bf16 matmul rate (bench/hardware.py's figures):
the engine sizes its prefill graphs from such rates (engine/cost_model.py), so the calculator needs
them to predict that memory.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

MiB = 1 << 20
GiB = 1 << 30


class Named(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...


P = TypeVar("P", bound=Named)


class PresetError(ValueError):
    """An unknown preset name or a malformed size; the message lists what is accepted."""


@dataclass(frozen=True)
class GPUPreset:
    name: str
    memory_bytes: int
    aliases: tuple[str, ...] = ()
    measured: bool = False  # True: CUDA's total as measured; False: nvidia-smi's memory.total
    rates: tuple[float, float] | None = None  # copy bandwidth (bytes/s, read + written), bf16 matmul FLOP/s


GPU_PRESETS: tuple[GPUPreset, ...] = (
    # rates: bench.hardware, one GPU's figures; the H100's matmul rate as sustained at its power limit
    # (2026-11-27; 795 on a cold GPU), the H200's as a cold GPU's first products (2026-11-26)
    GPUPreset("H100-80GB", 85_017_493_504, ("h100", "h100-sxm", "h100-80gb-hbm3"), measured=True,
              rates=(3.00e12, 677e12)),
    GPUPreset("H100-PCIe", 81559 * MiB, ("h100-pcie-80gb",)),
    GPUPreset("H100-NVL", 95830 * MiB, ("h100-94gb",)),
    GPUPreset("H200", 150_109_880_320, ("h200-141gb", "h200-sxm"), measured=True, rates=(4.25e12, 794e12)),
    GPUPreset("B200", 183359 * MiB, ("b200-180gb",)),
    GPUPreset("A100-80GB", 81920 * MiB, ("a100",)),
    GPUPreset("A100-40GB", 40960 * MiB),
    GPUPreset("L40S", 46068 * MiB),
    GPUPreset("L40", 46068 * MiB),
    GPUPreset("A6000", 49140 * MiB, ("rtx-a6000",)),
    GPUPreset("L4", 23034 * MiB),
    GPUPreset("A10", 23028 * MiB, ("a10g",)),
    GPUPreset("RTX4090", 24564 * MiB, ("4090", "geforce-rtx-4090")),
    GPUPreset("RTX3090", 24576 * MiB, ("3090", "geforce-rtx-3090")),
    GPUPreset("T4", 15360 * MiB),
    GPUPreset("V100-32GB", 32768 * MiB, ("v100",)),
    GPUPreset("V100-16GB", 16384 * MiB),
)


def preset_key(name: str) -> str:
    """Case, spaces, dashes, dots and underscores don't matter: 'Llama-3-8B' == 'llama3_8b'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_preset(presets: Iterable[P], name: str) -> P | None:
    """The preset whose name or alias is `name`, however spelled (preset_key)."""
    key = preset_key(name)
    return next((p for p in presets if key in {preset_key(n) for n in (p.name, *p.aliases)}), None)


def find_gpu_preset(name: str) -> GPUPreset | None:
    """By name or alias; CUDA's device names too ("NVIDIA H100 80GB HBM3")."""
    return find_preset(GPU_PRESETS, name) or find_preset(GPU_PRESETS, re.sub(r"(?i)^\s*nvidia\s+", "", name))


_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    # bare letters are binary, as in PyTorch and Docker: 80G is 80 GiB
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}


@dataclass(frozen=True)
class GPUMemory:
    label: str  # the preset name, or the size as given
    total_bytes: int
    rates: tuple[float, float] | None = None  # GPUPreset.rates, where known


def parse_size(text: str) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80000000000, '1.5 TiB', '512MiB', '1073741824B'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None:
        raise PresetError(f"can't read the size {text!r}: write a number and a unit, e.g. 80GiB or 80GB")
    unit = m.group(2).lower()
    if not unit:
        raise PresetError(f"the size {text!r} has no unit: write e.g. {text.strip()}GiB, {text.strip()}GB or {text.strip()}B")
    if unit not in _UNITS:
        raise PresetError(f"unknown unit {m.group(2)!r} in {text!r}: use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise PresetError(f"the size {text!r} must be more than zero")
    return size


def resolve_gpu_memory(spec: str) -> GPUMemory:
    """--gpu-memory: a GPU name (H100, A100-40GB, L4, ...) or a size with a unit (80GiB, 24GB)."""
    preset = find_gpu_preset(spec)
    if preset is not None:
        return GPUMemory(preset.name, preset.memory_bytes, preset.rates)
    if not re.match(r"\s*[\d.]", spec):
        names = ", ".join(p.name for p in GPU_PRESETS)
        raise PresetError(f"unknown GPU {spec!r}: give a size such as 80GiB, or one of {names}")
    return GPUMemory(spec.strip(), parse_size(spec))
