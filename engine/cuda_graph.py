"""Decode CUDA graphs: one graph per batch-size bucket, captured largest first into one shared
memory pool, replayed with static input buffers that the runner fills. A batch is padded up to
its bucket; padded slots write nowhere (slot -1) and attend to one token of block 0."""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from engine.attention import AttnMetadata, Ops
from engine.models.llama import LlamaForCausalLM
from kvcache.pool import LayerCache

log = logging.getLogger("pagedserve")


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 256, 16)) + list(range(256, 1025, 32))
    out = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


def smallest_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest of the sorted buckets that holds n, or None when n is beyond the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass
class StaticInputs:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    query_start_loc: torch.Tensor  # [max_bs + 1] int32 (0, 1, 2, ...)
    logit_indices: torch.Tensor  # [max_bs] int64 (0, 1, 2, ...)

    @classmethod
    def allocate(cls, max_bs: int, max_blocks: int, device: torch.device) -> "StaticInputs":
        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(z(max_bs, dtype=torch.int64), z(max_bs, dtype=torch.int64), z(max_bs, dtype=torch.int64),
                   z(max_bs, max_blocks, dtype=torch.int32), torch.ones(max_bs, dtype=torch.int32, device=device),
                   torch.arange(max_bs + 1, dtype=torch.int32, device=device),
                   torch.arange(max_bs, dtype=torch.int64, device=device))

    def meta(self, bs: int) -> AttnMetadata:
        return AttnMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.seq_lens[:bs],
                            self.query_start_loc[:bs + 1], num_decode=bs, max_query_len=1)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, ops: Ops, caches: list[LayerCache], max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device) -> None:
        self.model, self.ops, self.caches = model, ops, caches
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.inputs = StaticInputs.allocate(self.max_bs, max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.device = device
        self.pool_bytes = 0

    def _forward(self, bs: int) -> torch.Tensor:
        s = self.inputs
        return self.model(self.ops, s.input_ids[:bs], s.positions[:bs], self.caches, s.meta(bs), s.logit_indices[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        self.inputs.slot_mapping.fill_(-1)  # warm-up and capture runs write nowhere
        # cached blocks of earlier work would be released by the empty_cache() below and offset the
        # pool's growth (a tiny model's pool then measured 0 bytes)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._forward(bs)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = g
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager warm-ups' memory, cached by the allocator, goes back
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured %d decode graphs (batch 1..%d) in %.1f MiB", len(self.graphs), self.max_bs,
                 self.pool_bytes / 2**20)

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def replay(self, n: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Run n decode rows (device tensors) through the graph of their bucket -> logits [n, V]."""
        bs = self.bucket_for(n)
        s = self.inputs
        s.input_ids[:n].copy_(input_ids)
        s.positions[:n].copy_(positions)
        s.slot_mapping[:n].copy_(slot_mapping)
        s.seq_lens[:n].copy_(seq_lens)
        s.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        if bs > n:
            s.slot_mapping[n:bs].fill_(-1)
            s.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
