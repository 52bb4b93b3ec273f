"""The scheduler's half of prefill/decode disaggregation (`serve run --disaggregate P:D`): the
engine cores of the two roles, and the transport they move KV blocks with. Torch-free: the
transport is given (engine/kv_transfer.py on a real engine, a fake in the tests).

A request's way (serve/disagg.py drives it):
1. A prefill engine runs the prompt with max_tokens 1 and KVTransferParams(hand_off=True). Once
   the first token is sampled, PrefillCore keeps the prompt's blocks (`held`) instead of freeing
   them and ends the sequence with finish_reason "handoff" (or "stop"/"length" as usual when it
   ends there: nothing is kept then).
2. A decode engine gets the prompt plus that token, with KVTransferParams(remote_tokens=N).
   DecodeCore keeps it apart from the scheduler's queues (`arriving`) until it can allocate
   its blocks (back-pressure: FIFO, and only while the running sequences keep a free block each),
   then reports that with an output carrying no token ("ready").
3. The server has the prefill engine send the held blocks (send_kv) and then the decode engine
   receive them (receive_kv: the sequence joins the running decodes with the prompt computed).
   The decode side asks once it has room. Where the decode engine maps the prefill engine's pool
   (the transport lends_to it), send_kv only lends the blocks: receive_kv copies them itself, and
   the server releases them on the prefill side once the copy has landed (kv_copied). Otherwise
   send_kv pushes the pages and frees the blocks, and every send is matched by exactly one receive,
   in order (NCCL has no tags): receive_kv of a sequence aborted meanwhile drains the transfer into
   scratch memory.
An abort frees the held or lent blocks (prefill) or the arriving sequence's blocks (decode).

The decode side's first token is the prefill's; the prompt's KV moves in one batch after the
prefill, between steps of both engines (no overlap with the layers' compute yet).
"""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.core import EngineCore
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.request import Batch, ExecutorLost, SampleOutput, SamplingParams, Sequence, SequenceStatus, \
    StepOutput, next_seq_id

HANDOFF = "handoff"  # a prefill sequence's finish reason: its KV is held for a decode engine


class KVTransport(Protocol):
    """Moves the pages of KV blocks to and from a peer engine process (engine/kv_transfer.py)."""

    def lends_to(self, peer: int) -> bool: ...  # the peer copies our pages itself (pull), no send
    # bytes; copies peer's src_blocks into ours, on a GPU as later steps' predecessor on the device
    def pull(self, blocks: list[int], peer: int, src_blocks: list[int], tag: int) -> int: ...
    def copied(self, tag: int) -> bool: ...  # the pull has landed: the peer may reuse its blocks
    def send(self, blocks: list[int], peer: int, tag: int) -> int: ...  # bytes; the blocks may be reused on return
    # bytes written into the blocks; on a GPU the bytes may still be on their way, and every later
    # step of this engine waits for them on the device, not the host
    def recv(self, blocks: list[int], peer: int, tag: int) -> int: ...
    def discard(self, num_blocks: int, peer: int, tag: int) -> int: ...  # receive and drop
    def timings(self) -> list[tuple[int, float]]: ...  # (bytes, seconds) of each receive done since the last call


@dataclass
class TransferStats:
    num_transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # sending: host time; receiving: the timed receives' own time
    timed_bytes: int = 0  # the bytes of the receives that `seconds` counts

    def add_timed(self, timed: tuple[tuple[int, float], ...]) -> None:
        for n, s in timed:
            self.timed_bytes += n
            self.seconds += s


@dataclass(frozen=True)
class Sent:
    """What send_kv reports: the blocks' count and, when the peer pulls, the blocks it may copy
    (held here until the server releases them)."""

    num_blocks: int
    lent: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Received:
    """What receive_kv reports to the server: this transfer's bytes, and (bytes, seconds) of each
    receive that finished since the last report (on a GPU a receive finishes after receive_kv);
    `landing`: a pull still on its way (ask kv_copied before releasing the lent blocks)."""

    num_bytes: int
    timed: tuple[tuple[int, float], ...] = ()
    discarded: bool = False
    landing: bool = False


class _HeldBack:
    """A detokenizer fed as if more tokens follow: the prefill engine's first token is not the
    sequence's last when a decode engine continues it (an unfinished character or a possible stop
    string stays held back, as it would on one engine)."""

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok

    @property
    def stopped(self) -> bool:
        return self.detok.stopped

    def add(self, new_ids: list[int], final: bool = False) -> str:
        return self.detok.add(new_ids, False)


class PrefillCore(EngineCore):
    """An EngineCore that keeps the KV of hand_off sequences after their first token."""

    transport: KVTransport | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[int, list[int]] = {}  # seq id -> the blocks of its prompt's KV
        self.lent: dict[int, list[int]] = {}  # held blocks a decode engine is copying: until release_kv
        self.transfer = TransferStats()
        # the last step could schedule nothing while held or lent blocks fill the pool: only a send
        # or an abort (a command) frees them, so the engine loop waits for one instead of spinning
        self._stalled = False

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    seq_id: int | None = None) -> Sequence:
        self._stalled = False
        return super().add_request(prompt_token_ids, params, seq_id)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() and not self._stalled

    def step(self) -> list[StepOutput]:
        outputs = super().step()
        s = self.scheduler
        self._stalled = (bool(self.held or self.lent) and not outputs and not self._in_flight and not s.running
                         and s.hold_release is None)
        return outputs

    def _process(self, batch: Batch, samples: list[SampleOutput | None]) -> list[StepOutput]:
        bm = self.block_manager
        # update() frees a finished sequence's blocks: a reference taken first keeps them
        kept: dict[int, tuple[Sequence, list[int], IncrementalDetokenizer | None]] = {}
        for it in batch.items:
            seq = it.seq
            kv = seq.params.kv_transfer
            if it.samples and kv is not None and kv.hand_off and not seq.is_finished:
                for b in seq.block_table:
                    bm.share(b)
                detok = self.detok.get(seq.seq_id)
                if detok is not None:
                    self.detok[seq.seq_id] = _HeldBack(detok)  # type: ignore[assignment]
                kept[seq.seq_id] = (seq, list(seq.block_table), detok)
        outputs = super()._process(batch, samples)
        for out in outputs:
            entry = kept.pop(out.seq_id, None)
            if entry is None:
                continue
            seq, table, detok = entry
            if not out.finished:  # hand_off needs max_tokens 1: this one goes on here
                bm.free(table)
                if detok is not None:
                    self.detok[seq.seq_id] = detok
                continue
            stopped = detok is not None and detok.stopped
            if out.finish_reason == "length" and not out.error and not stopped:
                self.held[out.seq_id] = table[:bm.blocks_needed(seq.num_prompt_tokens)]
                bm.free(table[len(self.held[out.seq_id]):])
                out.finish_reason = HANDOFF
                continue
            bm.free(table)
            if stopped:
                out.finish_reason = "stop"  # a stop string in the first token: the request ends here
            elif detok is not None:
                out.new_text += detok.add([], True)  # it ends here after all: flush what was held back
        for _, table, _ in kept.values():  # no output (aborted while the step ran): nothing to keep
            bm.free(table)
        return outputs

    def send_kv(self, seq_id: int, peer: int, tag: int) -> Sent:
        """Send a held sequence's blocks to engine `peer` and free them, or lend them to a peer that
        pulls (kept until release_kv). Raises KeyError when nothing is held for it (aborted, or
        never handed off)."""
        assert self.transport is not None, "no KV transport"
        table = self.held.pop(seq_id)
        if self.transport.lends_to(peer):
            self.lent[seq_id] = table
            self.transfer.num_transfers += 1
            return Sent(len(table), tuple(table))
        self._stalled = False
        t0 = time.perf_counter()
        try:
            n = self.transport.send(table, peer, tag)
        finally:
            self.block_manager.free(table)
        self.transfer.num_transfers += 1
        self.transfer.num_bytes += n
        self.transfer.seconds += time.perf_counter() - t0
        return Sent(len(table))

    def abort(self, seq_id: int) -> bool:
        self._stalled = False
        table = self.held.pop(seq_id, None) or self.lent.pop(seq_id, None)
        if table is not None:
            self.block_manager.free(table)
            return True
        return super().abort(seq_id)

    def block_tables(self) -> list[list[int]]:
        """Every block table that owns blocks (for check_integrity)."""
        s = self.scheduler
        return [q.block_table for q in s.running + list(s.waiting)] + [*self.held.values(), *self.lent.values()]


class DecodeCore(EngineCore):
    """An EngineCore that admits sequences whose prompt KV arrives from a prefill engine."""

    transport: KVTransport | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arriving: dict[int, Sequence] = {}  # waiting for blocks, then for their KV; in arrival order
        self._ready: list[int] = []  # given blocks, not yet reported
        self.transfer = TransferStats()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    seq_id: int | None = None) -> Sequence:
        kv = params.kv_transfer
        if kv is None or kv.remote_tokens <= 0:
            return super().add_request(prompt_token_ids, params, seq_id)
        if self.lost is not None:
            raise ExecutorLost(self.lost)
        params = self.lora_params(params)  # this engine's number of the adapter (the prefill engine's may differ)
        n = kv.remote_tokens
        if not 0 < n < len(prompt_token_ids):
            raise ValueError(f"remote_tokens {n} must leave at least one generated token of {len(prompt_token_ids)}")
        seq = Sequence(seq_id if seq_id is not None else next_seq_id(), prompt_token_ids[:n], params,
                       eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)
        seq.token_ids.extend(prompt_token_ids[n:])
        self.scheduler.check_fits(seq)
        detok = IncrementalDetokenizer.for_params(self.tokenizer, params, self.token_bytes)
        detok.add(prompt_token_ids[n:])  # the prefill engine has sent this text already
        self.detok[seq.seq_id] = detok
        self.arriving[seq.seq_id] = seq
        self._allocate_arriving()
        return seq

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._ready)

    @property
    def num_arriving(self) -> int:
        return len(self.arriving)

    def step(self) -> list[StepOutput]:
        ready, self._ready = self._ready, []
        outputs = [StepOutput(sid, [], num_prompt_tokens=self.arriving[sid].num_prompt_tokens)
                   for sid in ready if sid in self.arriving]
        if super().has_unfinished():
            outputs += super().step()
        self._allocate_arriving()  # blocks the step freed
        return outputs

    def _allocate_arriving(self) -> None:
        """Blocks for the arriving sequences, first come first served, while each running sequence
        keeps a free block for its next decode (so arrivals never force a preemption) and the
        running plus arriving stay within max_num_seqs."""
        bm, running = self.block_manager, self.scheduler.running
        admitted = sum(1 for s in self.arriving.values() if s.block_table)
        for seq in self.arriving.values():
            if seq.block_table:
                continue
            if len(running) + admitted >= self.scheduler.config.max_num_seqs:
                return
            need = bm.blocks_needed(seq.num_tokens)  # the prompt and the first decode's token
            if need + len(running) > bm.num_free_blocks and (running or admitted):
                return
            table = bm.allocate(need)
            if table is None:
                return
            seq.block_table = table
            admitted += 1
            self._ready.append(seq.seq_id)

    def receive_kv(self, seq_id: int, peer: int, tag: int, num_blocks: int,
                   lent: Seq[int] | None = None) -> Received:
        """Receive a sequence's prompt KV from engine `peer`, which has sent it, or copy it from
        the peer's `lent` blocks, and start decoding it. A sequence aborted meanwhile: a sent
        transfer is drained and dropped, lent blocks are left alone."""
        assert self.transport is not None, "no KV transport"
        seq = self.arriving.get(seq_id)
        if seq is None or not seq.block_table:
            n = self.transport.discard(num_blocks, peer, tag) if lent is None else 0
            return Received(n, self._timed(), discarded=True)
        del self.arriving[seq_id]
        if num_blocks != self.block_manager.blocks_needed(seq.num_prompt_tokens) or (
                lent is not None and len(lent) != num_blocks):
            self._drop(seq)
            if lent is None:
                self.transport.discard(num_blocks, peer, tag)
            raise ValueError(f"sequence {seq_id}: {num_blocks} blocks sent for {seq.num_prompt_tokens} prompt tokens")
        try:
            blocks = seq.block_table[:num_blocks]
            if lent is None:
                n = self.transport.recv(blocks, peer, tag)
            else:
                n = self.transport.pull(blocks, peer, list(lent), tag)
        except BaseException:
            self._drop(seq)
            raise
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.first_token_time = time.monotonic()  # the prompt was not prefilled here (stats.prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        self.scheduler.seqs[seq.seq_id] = seq
        self.transfer.num_transfers += 1
        self.transfer.num_bytes += n
        return Received(n, self._timed(), landing=lent is not None and not self.transport.copied(tag))

    def _timed(self) -> tuple[tuple[int, float], ...]:
        timed = tuple(self.transport.timings())
        self.transfer.add_timed(timed)
        return timed

    def abort(self, seq_id: int) -> bool:
        seq = self.arriving.pop(seq_id, None)
        if seq is None:
            return super().abort(seq_id)
        self._drop(seq)
        self._allocate_arriving()
        return True

    def _drop(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.free(seq.block_table)
            seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        self.detok.pop(seq.seq_id, None)

    def block_tables(self) -> list[list[int]]:
        s = self.scheduler
        return [q.block_table for q in s.running + list(s.waiting)] + [q.block_table for q in self.arriving.values()]


# -- what the server runs in the engine processes (ProcessCore.call: picklable, module level) ----

def send_kv(core: PrefillCore, *, seq_id: int, peer: int, tag: int) -> Sent:
    return core.send_kv(seq_id, peer, tag)


def receive_kv(core: DecodeCore, *, seq_id: int, peer: int, tag: int, num_blocks: int,
               lent: tuple[int, ...] | None = None) -> Received:
    return core.receive_kv(seq_id, peer, tag, num_blocks, lent)


def kv_copied(core: DecodeCore, *, tag: int) -> bool:
    assert core.transport is not None, "no KV transport"
    return core.transport.copied(tag)


def release_kv(core: PrefillCore, *, seq_id: int) -> bool:
    return core.abort(seq_id)


def transfer_stats(core: EngineCore) -> TransferStats:
    return getattr(core, "transfer", TransferStats())
