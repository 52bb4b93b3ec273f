"""GPU memory that NCCL holds for the collectives CUDA graphs capture.

Each NCCL collective captured into a CUDA graph keeps about 120 KB of GPU memory for as long as the
graph lives. Measured on H100s (torch 2.11's NCCL, 2026-11-26), before the engine set it aside:
Llama-3-8B at TP=2 ended start-up 1.11 GB past its memory budget with 9,123 collectives captured
through NCCL (every all-reduce NCCL's) and 0.75 GB past it with ~6,200 (the one-shot all-reduce taking
those of 2 MiB or less): ~121 KB each; Llama-3-70B at TP=2 ended 1.20 and 2.12 GB past it with the
2 MiB and a 64 KiB limit, where this count predicts 1.45 and 2.26 GB (bench/NOTES.md). The engine sets
this memory aside before it sizes the KV pool, and `serve kv-calc` counts it the same way.
"""
from __future__ import annotations

NCCL_BYTES_PER_CAPTURE = 120_000


def forward_collectives(num_layers: int, first_stage: bool, last_stage: bool) -> tuple[int, int, int]:
    """(all-reduces a norm follows, other all-reduces, the greedy tokens' all-reduce) of one
    tensor-parallel forward over a stage of num_layers layers: two a layer (attention's and the
    MLP's row-parallel output), each summed with the norm after it, but for the last MLP's on a stage
    before the last (summed alone into the carry); the vocabulary-parallel embedding's on the first
    stage, summed with the first layer's norm; the largest of the ranks' greedy keys on the last."""
    return 2 * num_layers - int(not last_stage) + int(first_stage), int(not last_stage), int(last_stage)


def nccl_captures(decode_rows: list[int], prefill_tokens: list[int], row_bytes: int, num_layers: int,
                  first_stage: bool, last_stage: bool, one_shot_max_bytes: int, fused_max_bytes: int) -> int:
    """Collectives that go through NCCL inside the graphs: one decode graph per entry of decode_rows
    (its forward ends in the LM head), one graph or set of pieces per entry of prefill_tokens (no LM
    head). An all-reduce of rows x row_bytes up to one_shot_max_bytes takes the one-shot kernel
    instead, one a norm follows up to fused_max_bytes the kernel fused with the norm (0: none does)
    or else the one-shot kernel; the greedy tokens' all-reduce is always NCCL's."""
    normed, plain, greedy = forward_collectives(num_layers, first_stage, last_stage)

    def through_nccl(rows: int) -> int:
        size = rows * row_bytes
        # a norm's all-reduce that the fused kernel does not take goes to the one-shot one if it fits
        return normed * (size > max(fused_max_bytes, one_shot_max_bytes)) + plain * (size > one_shot_max_bytes)

    return sum(through_nccl(rows) + greedy for rows in decode_rows) + sum(map(through_nccl, prefill_tokens))
