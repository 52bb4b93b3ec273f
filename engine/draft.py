"""The draft model of speculative decoding (speculative_config {"model": folder, "num_speculative_tokens":
k}): a smaller model with the target's tokenizer proposes k tokens a sequence, greedily, and the target
verifies them in one step as it verifies n-gram drafts (the scheduler schedules the draft as k
placeholders, DEVICE_DRAFT; the runner fills them on the device before the step's forward, and reads
them back with the step's samples).

Its KV cache mirrors the target's blocks: a pool of its own with as many blocks of the same size, read
and written through the target's block tables, so it needs no allocator and no scheduling of its own.
It is written in drafting rounds only. Sequence.draft_kv counts the positions a sequence's draft KV
covers; a round first catches up the positions from there to the sequence's last token (its prompt at
its first round, then the tokens it took without a draft), in eager forwards of at most
max_num_batched_tokens tokens, then runs k + 1 greedy decode steps from the last token: the first k
give the draft, the last writes the k-th draft token's KV. Whatever prefix of the draft the target
keeps, the draft's KV then covers every position before the next round's last token. A sequence whose
block table is replaced (preempted) starts over, and so does one that shares cached prefix blocks: it
writes their draft KV again, with the same tokens at the same positions.

Under tensor parallelism rank 0 alone holds the draft model and broadcasts each round's drafts. The
scheduler decides whether a step drafts at all (scheduler/policy.py _drafts_pay), from the rounds'
cost timed at start-up (time_rounds).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttnMetadata, Ops
from engine.cuda_graph import DecodeGraphs
from engine.models.llama import LlamaForCausalLM
from kvcache.pool import KVPool
from kvcache.spec import KVCacheSpec
from scheduler.request import ScheduledSeq, Sequence


@dataclass
class Proposed:
    """A drafting round's result for one step: the drafts [k, n] of its drafted items (in batch order),
    and the source of the step's pending input tokens, the previous step's samples and then these
    (item i's j-th draft token at row at + j * n + i)."""
    tokens: torch.Tensor
    source: torch.Tensor
    at: int
    # per drafted item: its sequence, the position of its last token, its block table at launch
    items: list[tuple[Sequence, int, list[int]]]

    def rows(self, index: int) -> range:
        """Item index's draft tokens' rows of source."""
        n = self.tokens.shape[1]
        return range(self.at + index, self.at + index + self.tokens.shape[0] * n, n)


def draft_kv_done(seq: Sequence) -> int:
    """The positions of seq whose draft KV is written (0 where its block table has changed since)."""
    kv = seq.draft_kv
    return kv[1] if kv is not None and kv[0] is seq.block_table else 0


def catch_up_chunks(items: list[ScheduledSeq], budget: int) -> list[list[ScheduledSeq]]:
    """The chunks that bring each drafted item's draft KV up to its last token (exclusive), packed into
    forwards of at most budget tokens; a sequence's later chunk always lands in a later forward."""
    forwards: list[list[ScheduledSeq]] = []
    current: list[ScheduledSeq] = []
    room = budget
    for it in items:
        lo = draft_kv_done(it.seq)
        while lo < it.start:
            n = min(it.start - lo, room)
            current.append(ScheduledSeq(it.seq, lo, n))
            lo += n
            room -= n
            if room == 0:
                forwards.append(current)
                current, room = [], budget
    if current:
        forwards.append(current)
    return forwards


class DraftModel:
    """The draft model, its KV pool (allocate()) and, on a GPU, its decode graphs (capture()), which
    run a round's k + 1 steps as replays."""

    def __init__(self, model: LlamaForCausalLM, ops: Ops, num_tokens: int, kv_spec: KVCacheSpec) -> None:
        self.model, self.ops, self.k = model, ops, num_tokens
        self.kv_spec = kv_spec
        self.pool: KVPool | None = None
        self.graphs: DecodeGraphs | None = None

    def allocate(self, num_blocks: int, device: torch.device, dtype: torch.dtype) -> None:
        self.pool = KVPool(self.kv_spec, num_blocks, device, dtype)

    def capture(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        assert self.pool is not None
        self.graphs = DecodeGraphs(self.model, self.ops, self.pool.layers, max_num_seqs, max_blocks_per_seq,
                                   self.kv_spec.block_size, device, self.k + 1)
        self.graphs.capture()

    @torch.inference_mode()
    def time_rounds(self, timer: Callable[[Callable[[], object]], float]) -> dict[int, float]:
        """ms of a round's k + 1 replays of each decode graph (rows of padding: its weights and
        launches, the larger part of a small model's step), by batch size; timer(fn) -> ms."""
        g = self.graphs
        assert g is not None
        return {b: timer(lambda b=b: [g.graphs[b].replay() for _ in range(self.k + 1)]) for b in g.buckets}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> None:
        """Write the draft KV of a catch-up forward's tokens (no logits)."""
        assert self.pool is not None
        self.model(self.ops, input_ids, positions, self.pool.layers, meta, None)

    @torch.inference_mode()
    def steps(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """A round's k + 1 greedy decode steps, eagerly, from each row's last token at its position ->
        the tokens [k + 1, n]: row j of the step after position + j (the graphs' replay_steps on a GPU)."""
        assert self.pool is not None
        n = input_ids.shape[0]
        bs = self.kv_spec.block_size
        rows = torch.arange(n, device=input_ids.device)
        starts = torch.arange(n + 1, dtype=torch.int32, device=input_ids.device)
        out = torch.empty((self.k + 1, n), dtype=torch.int64, device=input_ids.device)
        ids, pos = input_ids, positions
        for j in range(self.k + 1):
            slots = block_tables[rows, pos // bs].long() * bs + pos % bs
            meta = AttnMetadata(slots, block_tables, (pos + 1).to(torch.int32), starts, num_decode=n, max_query_len=1)
            logits = self.model(self.ops, ids, pos, self.pool.layers, meta, rows)
            ids = torch.argmax(logits, dim=-1)
            out[j] = ids
            pos = pos + 1
        return out
