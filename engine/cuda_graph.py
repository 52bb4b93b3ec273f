"""Decode CUDA graphs: one graph per batch-size bucket, captured largest first into one shared
memory pool. A batch is padded up to its bucket; padded slots write nowhere (slot -1) and attend
to one token of block 0.

A replay costs the host two calls: one copy of the step's inputs, which the runner wrote into a
pinned buffer (kernels/graph_inputs.py has the layout), and the graph's launch. Inside the graph,
the first kernel spreads that buffer into the static inputs (taking pending input tokens from
`tokens`), and the last one writes each row's greedy token into `tokens`, where the host's copy
and the next step's pending rows read it.

A pipeline stage's graphs run its layers only: after the first stage they read the carry from the
static `carry` buffer (the runner copies the received one in before the replay), and before the
last they end with the carry out (replay_carry()) instead of logits and tokens.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention import AttnMetadata, Ops
from engine.models.llama import LlamaForCausalLM
from engine.upload import UploadRing
from kvcache.pool import LayerCache

log = logging.getLogger("pagedserve")


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 256, 16)) + list(range(256, 1025, 32))
    out = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


def head_words(n: int) -> int:
    """int64 words of an upload for n rows before its block tables (kernels/graph_inputs.py)."""
    return 2 + 3 * n


def capture_graph(fn: Callable[[], Any], pool: Any, mode: str = "global") -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn captured into a new graph in `pool`, and that graph launched once: a graph's first launch
    also uploads it to the device, which belongs in start-up, not in the first step that needs it.
    fn's inputs must be padding that writes nowhere when replayed as captured. mode: the capture's
    error mode; "thread_local" lets this thread load a kernel module (a Triton variant met first
    here) while it captures. -> (graph, fn's result)"""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, capture_error_mode=mode):
        out = fn()
    g.replay()
    return g, out


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
                 max_blocks_per_seq: int, block_size: int, device: torch.device, max_steps: int = 1) -> None:
        self.model, self.ops, self.caches = model, ops, caches
        self.buckets = graph_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.block_size = block_size
        self.inputs = StaticInputs.allocate(self.max_bs, max_blocks_per_seq, device)
        words = head_words(self.max_bs) + -(-self.max_bs * max_blocks_per_seq // 2)
        self.stage = torch.zeros(words, dtype=torch.int64, device=device)  # n = 0: every row is padding
        self.tokens = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        # replay_steps(): every step's tokens, and each row's own row (its next input is pending there)
        self.step_tokens = torch.zeros((max_steps, self.max_bs), dtype=torch.int64, device=device)
        self._rows = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        self._uploads = UploadRing(words * 8)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each bucket's output: logits, or a stage's carry out
        # with LoRA adapters (engine/lora.py): each bucket's graph and output without them, for the
        # steps in which no sequence uses one (the adapters' matmuls cost a decode step ~30%)
        self.plain: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.device = device
        self.pool_bytes = 0
        self.carry: torch.Tensor | None = None  # [2, max_bs, hidden]: a later pipeline stage's input
        if model.embed_tokens is None:
            dtype = next(model.parameters()).dtype
            self.carry = torch.zeros((2, self.max_bs, model.cfg.hidden_size), dtype=dtype, device=device)

    def _forward(self, bs: int) -> torch.Tensor:
        from kernels import graph_inputs  # Triton: only where graphs are captured

        s = self.inputs
        graph_inputs.unpack(self.stage, self.tokens, s.input_ids[:bs], s.positions[:bs], s.slot_mapping[:bs],
                            s.seq_lens[:bs], s.block_tables, self.block_size)
        carry = None if self.carry is None else self.carry[:, :bs]
        out = self.model(self.ops, s.input_ids[:bs], s.positions[:bs], self.caches, s.meta(bs), s.logit_indices[:bs],
                         carry, gather=False)
        if self.model.norm is not None:  # this rank's logits (not a pipeline stage's carry)
            self.model.greedy_tokens(self.ops, out, self.tokens[:bs])
        return out

    @torch.inference_mode()
    def dry_run(self) -> None:
        """Every bucket's forward once, inside kernels.launch.compile_ahead(): its new kernels compile."""
        self.inputs.slot_mapping.fill_(-1)
        for bs in reversed(self.buckets):
            self._forward(bs)

    @torch.inference_mode()
    def capture(self, without_adapters: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        """without_adapters: the model's LoRA adapters detached inside it; each bucket is captured
        once more that way (self.plain)."""
        self.inputs.slot_mapping.fill_(-1)  # warm-up and capture runs write nowhere
        # cached blocks of earlier work would be released by the empty_cache() below and offset the
        # pool's growth (a tiny model's pool then measured 0 bytes)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._forward(bs)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(self.device)
            self.graphs[bs], self.logits[bs] = capture_graph(lambda: self._forward(bs), pool)
        if without_adapters is not None:
            with without_adapters():
                for bs in reversed(self.buckets):
                    self._forward(bs)
                    torch.cuda.synchronize(self.device)
                    self.plain[bs] = capture_graph(lambda: self._forward(bs), pool)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager warm-ups' memory, cached by the allocator, goes back
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured %d decode graphs (batch 1..%d%s) in %.1f MiB", len(self.graphs), self.max_bs,
                 ", with and without the LoRA adapters" if self.plain else "", self.pool_bytes / 2**20)

    def bucket_for(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def host_inputs(self) -> np.ndarray:
        """The pinned buffer (int64 words) to write the next replay's inputs into."""
        return self._uploads.buffer().view(np.int64)

    def _graph(self, bs: int, adapters: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Bucket bs's graph and output; adapters=False: the one without LoRA adapters, if captured."""
        if not adapters and self.plain:
            return self.plain[bs]
        return self.graphs[bs], self.logits[bs]

    def replay(self, n: int, words: int, logits: bool = True,
               adapters: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Upload the first `words` of host_inputs() and run the graph of n rows' bucket ->
        (logits [n, V] or None without `logits`, greedy tokens [n]). The tokens are a view of a
        static buffer that the next replay overwrites, and so are the logits on one GPU (under
        tensor parallelism they are gathered after the graph: its greedy tokens need no gather).
        adapters=False: no row uses a LoRA adapter (the graph without them serves)."""
        self._uploads.send(self.stage.view(torch.uint8), words * 8)
        graph, out = self._graph(self.bucket_for(n), adapters)
        graph.replay()
        return (self.model.gather_logits(out[:n]) if logits else None), self.tokens[:n]

    def replay_carry(self, n: int, words: int, adapters: bool = True) -> torch.Tensor:
        """replay() on a pipeline stage before the last -> its carry out [2, n, hidden], a view of a
        static buffer that the next replay overwrites."""
        self._uploads.send(self.stage.view(torch.uint8), words * 8)
        graph, out = self._graph(self.bucket_for(n), adapters)
        graph.replay()
        return out[:, :n]

    def replay_steps(self, n: int, words: int, steps: int,
                     draw: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                     adapters: bool = True) -> torch.Tensor:
        """replay(), then steps - 1 more replays, each on the tokens the one before sampled, one
        position further: on the device, the staged positions go up by one and every row's input is
        pending on its own row, so the host only queues the replays (the rows' blocks must cover
        all the positions). draw(logits [n, V], step) -> tokens [n]: where rows sample rather than
        take the graph's greedy tokens, queued after each replay, its tokens the next one's input.
        -> every step's tokens [steps, n], a view of a static buffer."""
        _, tokens = self.replay(n, words, logits=False, adapters=adapters)
        graph, logits = self._graph(self.bucket_for(n), adapters)
        out = self.step_tokens[:steps, :n]
        positions = self.stage[2 + n:2 + 2 * n]
        self.stage[2 + 2 * n:2 + 3 * n].copy_(self._rows[:n])
        for j in range(steps):
            if j:
                positions.add_(1)
                graph.replay()
            if draw is not None:
                tokens.copy_(draw(self.model.gather_logits(logits[:n]), j))
            out[j].copy_(tokens)
        return out
