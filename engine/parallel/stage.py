"""A pipeline stage: which contiguous layers a rank's model holds, and whether it embeds the input
(the first stage) or applies the final norm, the LM head and the sampler (the last). The split is
kvcache/calc.py's stage_layer_ranges, which `serve kv-calc` sizes the per-GPU KV cache with."""
from __future__ import annotations

from dataclasses import dataclass

from kvcache.calc import stage_layer_ranges


@dataclass(frozen=True)
class Stage:
    rank: int  # the stage's index, 0 .. size - 1
    size: int
    start: int  # its layers: [start, end)
    end: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def owns_layer(self, i: int) -> bool:
        return self.start <= i < self.end


def whole_model(num_layers: int) -> Stage:
    return Stage(0, 1, 0, num_layers)


def stage_of(num_layers: int, rank: int, size: int) -> Stage:
    start, end = stage_layer_ranges(num_layers, size)[rank]
    return Stage(rank, size, start, end)
