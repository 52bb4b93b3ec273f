"""Rank 0's batches for the other ranks, as deltas: a sequence's parameters travel once, then each
step carries per item its share (start, tokens, whether it samples) and only what its token list
and block table gained since the last step that sent them. The followers keep mirrored Sequence
objects, so their runners see the same token ids and block tables as rank 0's.

The scheduler grows a sequence's token list and block table in place, and gives a sequence a new
block table (a new list) when it is preempted or admitted again; a list that is not the one last
sent, or is shorter, travels whole."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import Batch, ScheduledSeq, Sequence, SequenceStatus

# (new sequences [(seq_id, params, num_prompt_tokens)], rows, num_decode, num_steps, dropped seq_ids,
# host-tier moves (kvcache/host_tier.py KVMoves, or None): each rank does them on its own shard);
# a row: (seq_id, start, num_new_tokens, samples, token base, tokens from it, new table?, table base,
# table entries from it, draft or None)
Message = tuple
# ([(seq_id, token base, tokens from it)], seq_ids finished)
TokenUpdate = tuple[list[tuple[int, int, list[int]]], list[int]]


@dataclass
class _Sent:
    seq: Sequence
    tokens: list[int] | None = None  # the list last sent from, and how much of it
    num_tokens: int = 0
    table: list[int] | None = None
    num_table: int = 0


class BatchEncoder:
    """Rank 0's side: what each follower already has."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def encode(self, batch: Batch) -> Message:
        new, rows = [], []
        sent = self._sent
        for it in batch.items:
            seq = it.seq
            s = sent.get(seq.seq_id)
            if s is None:
                s = sent[seq.seq_id] = _Sent(seq)
                new.append((seq.seq_id, seq.params, seq.num_prompt_tokens))
            base, toks = _token_delta(s)
            table = seq.block_table
            fresh = table is not s.table or len(table) < s.num_table
            tbase = 0 if fresh else s.num_table
            rows.append((seq.seq_id, it.start, it.num_new_tokens, it.samples, base, toks, fresh, tbase,
                         table[tbase:], it.draft))
            s.table, s.num_table = table, len(table)
        dropped = [sid for sid, s in sent.items() if s.seq.is_finished]
        for sid in dropped:
            del sent[sid]
        return new, rows, batch.num_decode, batch.num_steps, dropped, batch.kv_moves

    def tokens(self, seqs: list[Sequence]) -> TokenUpdate:
        """What the followers' copies of seqs (sent before) lack of their token lists, and which of
        them have finished since: a launched step's constrained rows, whose masks each rank fills
        once the tokens before them are known (engine/runner.py finish())."""
        rows, finished = [], []
        for seq in seqs:
            if seq.is_finished:
                finished.append(seq.seq_id)
            else:
                rows.append((seq.seq_id, *_token_delta(self._sent[seq.seq_id])))
        return rows, finished


def _token_delta(s: _Sent) -> tuple[int, list[int]]:
    """(base, tokens from it) that bring the followers' copy of s.seq's token list up to date, and
    the record of what they then hold."""
    toks = s.seq.token_ids
    base = s.num_tokens if toks is s.tokens and len(toks) >= s.num_tokens else 0
    s.tokens, s.num_tokens = toks, len(toks)
    return base, toks[base:]


class BatchDecoder:
    """A follower's side: mirrored sequences, kept until rank 0 drops them."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}

    def decode(self, msg: Message) -> Batch:
        new, rows, num_decode, num_steps, dropped, kv_moves = msg
        seqs = self.seqs
        for sid in dropped:
            seq = seqs.pop(sid, None)
            if seq is not None:  # a launched step may still hold it (its grammar state is dropped)
                seq.status = SequenceStatus.FINISHED
        for sid, params, num_prompt in new:
            seq = Sequence(sid, [], params)
            seq.num_prompt_tokens = num_prompt
            seqs[sid] = seq
        items = []
        for sid, start, n, samples, base, toks, fresh, tbase, table, draft in rows:
            seq = seqs[sid]
            _extend(seq, base, toks)
            if fresh:
                seq.block_table = table  # a new list: the runner's cached row of the old one is dropped
            else:
                assert len(seq.block_table) == tbase, "block tables out of step"
                seq.block_table.extend(table)
            item = ScheduledSeq(seq, start, n, draft)
            item.samples = samples
            items.append(item)
        return Batch(items, num_decode, num_steps, kv_moves)

    def apply_tokens(self, update: TokenUpdate) -> None:
        """BatchEncoder.tokens()'s update, onto the copies (rank 0 drops finished ones only later)."""
        rows, finished = update
        for sid, base, toks in rows:
            _extend(self.seqs[sid], base, toks)
        for sid in finished:
            self.seqs[sid].status = SequenceStatus.FINISHED


def _extend(seq: Sequence, base: int, toks: list[int]) -> None:
    del seq.token_ids[base:]
    seq.token_ids.extend(toks)
