"""The scheduling policy: which sequences run in the next step, and with how many tokens.

Each step carries every running decode first (one token each, oldest first), then prompt tokens:
running sequences' unfinished prompts (oldest first), then waiting sequences in arrival order, as
chunked prefills. Prompt tokens share a budget: max_num_batched_tokens with no decode in the step
(a lone prompt runs at full speed), else what `prompt_budget` allows beside the decodes (measured
on the GPU by engine/cost_model.py: the step stays near the latency target, so a burst of prompts
never stalls the streams; stall-free batching as in SARATHI-Serve). The budget is also told a
demand. While the cache holds the waiting prompts back, a budget that paces by it (a pipeline's
stages: SchedulerConfig.paced) gets the prompt tokens a step needs to admit them as fast as
sequences end. Otherwise, while prompts wait to start, it gets the backlog: the prompt tokens a step
needs for every sequence that could run to be decoding. Without it a model whose few-row steps are
much cheaper than its prompt steps (4-bit weights) settles where the stall target admits prompts
only as fast as the few decodes end, and the rest wait for seconds. When the
cache runs out for a decode, the newest running sequence is preempted (its blocks freed, recomputed
later) and re-queued at the front; a prompt chunk that finds no blocks waits instead.

Priorities (SamplingParams.priority, vLLM's: lower runs sooner; all 0 by default, which is the
order above): waiting sequences line up by priority, then arrival; running ones keep their order
within a priority, so the one preempted first is the newest of the lowest priority; and a waiting
sequence of higher priority than the lowest running one preempts it where it could not start
otherwise (max_num_seqs running, or too few free blocks for its prompt).

Prefill hold (prefill_hold_s > 0, off by default): new prompts that arrive as a burst wait for
the rest of it and start as one prefill. They wait until no new prompt has arrived for
prefill_hold_s, at most HOLD_CAP times that after the first of them, and only while they would
not fill the step (its token budget or max_num_seqs) anyway. A sequence's time per output token
includes every prefill step it sits through while decoding. In a closed loop of equal requests,
a burst split over several steps makes its earliest part sit through the rest. The parts then
finish a step apart and split the next burst the same way, run after run. An engine with nothing
to run also holds (hold_release says until when), because the first prompts of a burst reach an
idle engine first.

Async scheduling: schedule() may run while the previous step is still on the GPU. A sequence
then has a pending token (sampled by that step, its value not yet known here): its next decode
reads the token on the device, its count is known, and a sequence whose pending token is its
last by length is not scheduled again. schedule() commits the step at once (num_computed_tokens,
num_pending); update() later appends the sampled tokens. Torch-free.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvcache.block_manager import BlockManager
from scheduler.ngram import NgramProposer
from scheduler.request import (DEVICE_DRAFT, Batch, SampleOutput, ScheduledSeq, Sequence, SequenceStatus,
                               SpeculativeConfig, StepOutput)

HOLD_CAP = 4  # a held prompt waits at most HOLD_CAP * prefill_hold_s
# speculative decoding where drafts do not pay: a drafting step now and then measures again what they
# keep, at least PROBE_STEPS steps apart and as far apart as keeps the probes' extra time PROBE_SHARE
# of the steps'; each drafted sequence moves the kept-tokens average KEPT_WEIGHT of the way
PROBE_STEPS = 16
PROBE_SHARE = 0.03
KEPT_WEIGHT = 0.25
ENDED_DECAY = 0.95  # the weight of the last ended sequence's lengths against those before (_demand)


class RequestRejected(ValueError):
    """The request can never be served with this configuration; the message says why."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    prefill_hold_s: float = 0.0  # the quiet time that ends a burst of new prompts (see above)
    num_scheduler_steps: int = 1  # decode steps per schedule() when only greedy decodes run (_steps)
    # prompt tokens a step may carry beside its decodes: (decodes, their context tokens, demand) ->
    # tokens, where demand (None unless prompts wait) is the prompt tokens a step needs: paced, to
    # keep pace with the sequences that end while the cache holds the waiting prompts back
    # (_demand), else to work off the backlog (_backlog); None: max_num_batched_tokens less the
    # decodes (see the module's docstring)
    prompt_budget: Callable[[int, int, int | None], int] | None = None
    # the budget paces prompts by the demand (a pipeline stage's cost model): only then is it computed,
    # so that other engines' steps don't pay for a look at the waiting prompts they would ignore
    paced: bool = False
    # speculative decoding: decodes carry n-gram drafts (scheduler/ngram.py) or a draft model's
    # placeholders (DEVICE_DRAFT, filled by the runner: engine/draft.py); a step with drafts is
    # collected before the next is scheduled (the tokens it keeps are known only once it has run)
    speculative: SpeculativeConfig | None = None
    # LoRA adapters (scheduler/lora.py): those loaded at start-up, (name, folder); runtime: more load
    # while serving
    lora_modules: tuple[tuple[str, str], ...] = ()
    runtime_loras: bool = False
    # (sequences) -> what a step in which they all draft costs against a step in which they decode
    # (the runner's cost model, a draft model's rounds timed at start-up); drafts are taken while the
    # tokens a drafted sequence keeps a step, on average, make up for it. None: always (the CPU)
    speculation_ratio: Callable[[int], float] | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        # the LoRA adapters' numbers requests may use (SamplingParams.lora): scheduler/lora.py keeps it
        self.loras: set[int] = set()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prioritized = False  # a sequence with a priority other than 0 has come: keep the queues by it
        self.seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found cached (in either tier)
        self.prefix_cache_host_hits = 0  # of which found in the host tier (kvcache/host_tier.py)
        self.num_held_steps = 0  # schedules that left new prompts waiting for the rest of their burst
        self.hold_release: float | None = None  # when the prompts held by the last schedule() start anyway
        self._prompted = False  # the last step carried prompt tokens (multi-step: a decode round is next)
        # prompt and output tokens of the sequences that ended, the older ones decayed (_demand)
        self._ended_prompt = self._ended_output = 0.0
        spec = config.speculative
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
                         if spec is not None and spec.method == "ngram" else None)
        self.num_draft_tokens = 0  # draft tokens verified, and of them accepted
        self.num_accepted_tokens = 0
        self.num_drafts = 0  # drafts verified (a sequence's in a step)
        # tokens a drafted sequence kept a step, a running average (optimistic at first); the steps
        # since drafts last paid (_drafts_pay)
        self.kept_per_draft = float(spec.num_speculative_tokens + 1) if spec is not None else 0.0
        self._unpaid_steps = 0

    @property
    def speculating(self) -> bool:
        """Decodes carry drafts (n-gram or a draft model's)."""
        return self.config.speculative is not None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def check_fits(self, seq: Sequence) -> None:
        """Raise RequestRejected if seq could not be served even alone."""
        n = seq.num_prompt_tokens
        if n == 0:
            raise RequestRejected("the prompt is empty; send at least one token")
        if seq.params.lora and seq.params.lora not in self.loras:
            raise RequestRejected(f"LoRA adapter {seq.params.lora} is not loaded (loaded: "
                                  f"{', '.join(map(str, sorted(self.loras))) or 'none'})")
        if n >= self.config.max_model_len:
            raise RequestRejected(f"the prompt has {n} tokens but the model's context length is "
                                  f"{self.config.max_model_len}; shorten the prompt to at most "
                                  f"{self.config.max_model_len - 1} tokens")
        need = self.bm.blocks_needed(seq.max_total_tokens())
        if need > self.bm.num_blocks:
            raise RequestRejected(f"the request needs up to {seq.max_total_tokens()} tokens of KV cache "
                                  f"({need} blocks) but the whole cache holds {self.bm.num_blocks} blocks; "
                                  f"lower max_tokens or the prompt length")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self._prioritized = self._prioritized or seq.params.priority != 0
        if self._prioritized:  # after every waiting one of its priority or a higher one
            p = seq.params.priority
            i = len(self.waiting)
            while i and self.waiting[i - 1].params.priority > p:
                i -= 1
            self.waiting.insert(i, seq)
        else:
            self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq

    def schedule(self, now: float | None = None, busy: set[int] | None = None,
                 max_seqs: int | None = None) -> Batch | None:
        """The next step's batch; `now` (time.monotonic()) only matters for the prefill hold. A
        batch queue's micro-batch (schedule_micro_batch): busy, the ids of sequences in batches still
        in flight, which no other batch may carry (they may still be preempted), and max_seqs, the
        most sequences this batch takes, so that the queue's batches share the work."""
        decodes: list[ScheduledSeq] = []  # items of one new token: they lead the batch, in order
        others: list[ScheduledSeq] = []  # decodes with a draft, then prompt chunks
        if self._prioritized:
            self._preempt_for_priority()
        preempted = self._schedule_decodes(decodes, busy, max_seqs, others)
        rows = len(decodes) + sum(it.num_new_tokens for it in others)  # a draft's tokens cost as rows
        budget = self.config.max_num_batched_tokens - rows
        # multi-step with a prompt budget: after a step with prompt tokens comes a round of decode
        # steps, prompts waiting (one round at most), so that the host's work per round is paid once
        # for several steps
        budgeted = self.config.prompt_budget is not None
        decode_round = budgeted and self.config.num_scheduler_steps > 1 and self._prompted and bool(decodes)
        if decode_round:
            budget = 0
        elif rows and budgeted:
            # it.end: the decode's context, its new tokens included
            demand = self._demand(len(decodes) + len(others)) if self.config.paced else self._backlog()
            context = sum(it.end for it in decodes) + sum(it.end for it in others)
            budget = min(budget, self.config.prompt_budget(rows, context, demand))
        drafts = len(others)
        room = None if max_seqs is None else max_seqs - len(decodes) - drafts
        budget, preempted_for_prompt = self._schedule_prefills(budget, others, not rows, busy, room)
        preempted = preempted or preempted_for_prompt
        self.hold_release = None
        # admitting new work right after a preemption would only thrash: wait for room
        if not preempted and not self._hold(budget, now):
            self._admit_waiting(budget, decodes, others, busy, max_seqs)
        items = decodes + others if others else decodes
        if not items:
            return None
        # a prompt waits for its turn only where it could start (not while max_num_seqs are running)
        prompts_wait = (bool(self.waiting) and not decode_round
                        and len(self.running) < self.config.max_num_seqs)
        steps = 1 if others else self._steps(decodes, prompts_wait)
        self._prompted = len(others) > drafts
        for it in items:  # the step is committed: the next schedule() continues after it
            seq = it.seq
            seq.num_computed_tokens = it.end + steps - 1
            seq.num_pending += it.samples * steps
        return Batch(items, len(decodes), steps)

    def schedule_micro_batch(self, busy: set[int], parts: int) -> Batch | None:
        """The next batch of a queue of `parts` in flight at once (pipeline stages): of sequences
        not in busy (those in flight), and at most its share of the unfinished ones, so that every
        stage gets work."""
        return self.schedule(busy=busy, max_seqs=max(1, -(-self.num_unfinished // parts)))

    def _steps(self, decodes: list[ScheduledSeq], prompts_wait: bool) -> int:
        """How many decode steps a decode-only batch runs at once (multi-step scheduling). The
        engine loop's host work (scheduling, launching, processing and sending the tokens) is then
        paid once for all of them, which keeps the GPU busy where that work takes about as long as
        a step (a small model). Only while no prompt waits for its turn (with a prompt budget a
        round of decodes follows a step with prompt tokens: prompts wait one round at most), for
        rows without logprobs or a grammar (a grammar's mask needs the token before it on the host;
        the runner samples each step on the device), and never past a sequence's end by length, so
        no row idles; a stop token can still end a row
        early (update() drops its later tokens; a stop string, found by the detokenizer after
        update(), cuts the text but leaves up to K - 1 tokens past it in the output's ids). Each
        sequence gets the cache blocks of all the steps, or the batch runs one step."""
        k = self.config.num_scheduler_steps
        if k <= 1 or prompts_wait or self.speculating:  # a draft needs its sequence's last token
            return 1
        max_len = self.config.max_model_len
        for it in decodes:
            seq = it.seq
            p = seq.params
            if p.logprobs is not None or p.grammar is not None:
                return 1
            total = len(seq.token_ids) + seq.num_pending  # the tokens once those in flight are known
            k = min(k, max_len - total)
            if p.max_tokens is not None:
                k = min(k, p.max_tokens - (total - seq.num_prompt_tokens))
            if k <= 1:
                return 1
        bm = self.bm
        for it in decodes:
            if bm.append(it.seq.block_table, it.start + k) is None:
                return 1  # blocks already added to other rows stay theirs, for their next steps
        return k

    def _schedule_decodes(self, decodes: list[ScheduledSeq], busy: set[int] | None = None,
                          max_seqs: int | None = None, drafted: list[ScheduledSeq] | None = None) -> bool:
        """Every running sequence whose next step is one token, oldest first; preempts the newest
        when the cache is full. With speculative decoding, those with a draft go to drafted (their
        input: the last token and the draft) where the cache and the step's tokens have room for it.
        Returns whether anything was preempted."""
        bm, bs, running = self.bm, self.bm.block_size, self.running
        most = self.config.max_num_batched_tokens if max_seqs is None else min(max_seqs, self.config.max_num_batched_tokens)
        drafting = drafted is not None and self.speculating and self._drafts_pay()
        tokens = 0  # of drafts
        preempted = False
        i = 0
        while i < len(running) and len(decodes) + (len(drafted) if drafted else 0) < most:
            seq = running[i]
            if busy and seq.seq_id in busy:
                i += 1
                continue
            pending = seq.num_pending
            start = seq.num_computed_tokens
            if (pending and seq.last_by_length()) or len(seq.token_ids) + pending - start != 1:
                i += 1  # its token in flight is its last (update() finishes it), or it is mid-prompt
                continue
            while bm.append(seq.block_table, start + 1) is None:
                victim = running[-1]  # never one scheduled already: those come before i
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                draft = None
                if drafting and pending <= 1:
                    room = self.config.max_num_batched_tokens - len(decodes) - len(drafted) - tokens - 1
                    draft = self._draft(seq, start, room, len(running) - i - 1, pending)
                if draft:
                    drafted.append(ScheduledSeq(seq, start, 1 + len(draft), draft))
                    tokens += len(draft)
                else:
                    decodes.append(ScheduledSeq(seq, start, 1))
                if start < len(seq.token_ids) and (start + 1) % bs == 0:  # a block completed by a known token
                    bm.cache_blocks(seq.block_table, seq.token_ids, seq.block_hashes, start, start + 1, seq.hash_root)
                i += 1
        return preempted

    def _drafts_pay(self) -> bool:
        """Whether this step's decodes take drafts: while the tokens a drafted sequence keeps make up for
        what drafting costs a step of this many sequences (SchedulerConfig.speculation_ratio), and
        otherwise in a probe step now and then, which measures the drafts again."""
        cost = self.config.speculation_ratio
        ratio = 1.0 if cost is None else cost(max(1, len(self.running)))
        if self.kept_per_draft >= ratio:
            self._unpaid_steps = 0
            return True
        self._unpaid_steps += 1
        if self._unpaid_steps < max(PROBE_STEPS, (ratio - 1.0) / PROBE_SHARE):
            return False
        self._unpaid_steps = 0
        return True

    def _draft(self, seq: Sequence, start: int, room: int, others: int, pending: int) -> list[int] | None:
        """seq's draft to follow its last token (at position start), as long as its output, the
        context, the step's tokens (room) and the cache allow, leaving a free block for each of the
        `others` sequences still to decode (a draft never preempts); None for rows whose sampling
        depends on more than the logits (logprobs, a grammar, logit adjustments). An n-gram draft:
        with its last token pending (sampled by the step in flight), the lookup's first token stands
        in for it and the draft is what follows; where the pending token differs, the draft is most
        likely rejected, never wrong. A draft model's: num_speculative_tokens placeholders
        (DEVICE_DRAFT) that the runner fills on the device, from the pending token too, or none
        where fewer fit (the draft model runs every row of its batch as far)."""
        p = seq.params
        if p.logprobs is not None or p.grammar is not None or p.adjusts_logits:
            return None
        limit = min(room, self.config.max_model_len - 1 - start)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - (len(seq.token_ids) + pending - seq.num_prompt_tokens) - 1)
        if self.proposer is None:
            k = self.config.speculative.num_speculative_tokens
            if limit < k:
                return None
            draft = [DEVICE_DRAFT] * k
        else:
            draft = self.proposer.propose(seq.seq_id, seq.token_ids, limit + pending)[pending:]
            if not draft:
                return None
        bm = self.bm
        new_blocks = bm.blocks_needed(start + 1 + len(draft)) - len(seq.block_table)
        if new_blocks > 0 and (new_blocks > bm.num_free_blocks - others
                               or bm.append(seq.block_table, start + 1 + len(draft)) is None):
            return None
        return draft

    def _schedule_prefills(self, budget: int, others: list[ScheduledSeq], may_preempt: bool,
                           busy: set[int] | None = None, room: int | None = None) -> tuple[int, bool]:
        """Running sequences' unfinished prompts, oldest first, within the budget. A chunk that finds
        no free blocks waits while decodes run (they free blocks as they finish; preempting for a
        prompt would only thrash); with none running it preempts the newest unscheduled sequence,
        or nothing could ever move. Returns the budget left and whether anything was preempted."""
        bm, bs, running = self.bm, self.bm.block_size, self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            if room is not None and len(others) >= room:
                break
            seq = running[i]
            if busy and seq.seq_id in busy:
                i += 1
                continue
            pending = seq.num_pending
            start = seq.num_computed_tokens
            need = len(seq.token_ids) + pending - start
            if need <= 1 or (pending and seq.last_by_length()):
                i += 1
                continue
            n = min(need, budget)
            while bm.append(seq.block_table, start + n) is None:
                # only sequences after i are unscheduled in this step (no decodes ran)
                if not may_preempt or running[-1] is seq:
                    return budget, preempted
                self._preempt(running[-1])
                preempted = True
            others.append(ScheduledSeq(seq, start, n))
            end = min(start + n, len(seq.token_ids))  # a block completed by a pending token: see update()
            if end // bs > start // bs:
                bm.cache_blocks(seq.block_table, seq.token_ids, seq.block_hashes, start, end, seq.hash_root)
            budget -= n
            i += 1
        return budget, preempted

    def _demand(self, decodes: int) -> int | None:
        """Where the waiting prompts need more tokens than the free blocks hold (they then start only
        as running sequences end, whatever the steps' budget): the prompt tokens a step of these
        decodes needs to admit them as fast as the sequences end, from the prompt and output
        lengths of the sequences that ended last. Else None."""
        if self._ended_output <= 0:
            return None
        room = self.bm.num_free_blocks * self.bm.block_size
        need = 0
        # as many as could start (the rest wait for max_num_seqs, not for blocks)
        for seq in itertools.islice(self.waiting, max(self.config.max_num_seqs - len(self.running), 0)):
            need += len(seq.token_ids)
            if need > room:
                return math.ceil(decodes * self._ended_prompt / self._ended_output)
        return None

    def _backlog(self) -> int | None:
        """While prompts wait to start: the prompt tokens a step needs for every sequence that could
        run (running and waiting, up to max_num_seqs) to be decoding, each admitting its successor's
        prompt as it ends, from the prompt and output lengths of the sequences that ended last. A
        step that carries fewer only keeps pace with the decodes it has, and the waiting ones never
        catch up. Else None."""
        if not self.waiting or self._ended_output <= 0:
            return None
        could_run = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return math.ceil(could_run * self._ended_prompt / self._ended_output)

    def _hold(self, budget: int, now: float | None) -> bool:
        """Whether the new prompts wait for the rest of their burst (the module's docstring)."""
        quiet = self.config.prefill_hold_s
        waiting = self.waiting
        if quiet <= 0 or not waiting or waiting[0].num_preemptions:
            return False  # preempted sequences are not new: they go first, as before
        release = min(waiting[0].arrival_time + HOLD_CAP * quiet, waiting[-1].arrival_time + quiet)
        if (time.monotonic() if now is None else now) >= release:
            return False
        if (len(self.running) + len(waiting) >= self.config.max_num_seqs
                or sum(s.num_prompt_tokens for s in waiting) >= budget):
            return False  # a full step already: waiting for more would only delay it
        self.num_held_steps += 1
        self.hold_release = release
        return True

    def _admit_waiting(self, budget: int, decodes: list[ScheduledSeq], others: list[ScheduledSeq],
                       busy: set[int] | None = None, max_seqs: int | None = None) -> None:
        """Waiting sequences in arrival order, as chunked prefills for the budget left."""
        bm, bs = self.bm, self.bm.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if max_seqs is not None and len(decodes) + len(others) >= max_seqs:
                break
            seq = self.waiting[0]
            if seq.num_pending or (busy and seq.seq_id in busy):
                break  # preempted while its last step was in flight: wait for that step
            num_tokens = len(seq.token_ids)
            if seq.computes_whole_prompt:  # every prompt token's hidden state is needed: nothing is read from the cache
                hits, host_hits = [], []
            else:
                hits = bm.match_prefix(seq.token_ids, seq.block_hashes, seq.hash_root)
                host_hits = bm.match_host(seq.token_ids, seq.block_hashes, len(hits), seq.hash_root) if bm.host is not None else []
            if (len(hits) + len(host_hits)) * bs >= num_tokens:
                (host_hits or hits).pop()  # compute at least the last block, so the step yields logits
            num_cached = (len(hits) + len(host_hits)) * bs
            n = min(num_tokens - num_cached, budget)
            table = bm.admit(hits, num_cached + n, host_hits)
            if table is None:
                break
            self.waiting.popleft()
            seq.block_table = table
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            if bm.enable_caching:
                self.prefix_cache_queries += num_tokens
                self.prefix_cache_hits += num_cached
                self.prefix_cache_host_hits += len(host_hits) * bs
            seq.status = SequenceStatus.RUNNING
            if self._prioritized:  # after the running ones of its priority or a higher one
                i = len(self.running)
                while i and self.running[i - 1].params.priority > seq.params.priority:
                    i -= 1
                self.running.insert(i, seq)
            else:
                self.running.append(seq)
            (decodes if n == 1 else others).append(ScheduledSeq(seq, num_cached, n))
            # Registered now, so the next waiting sequence with the same prefix shares these
            # blocks within this very step instead of computing the prefix again.
            bm.cache_blocks(table, seq.token_ids, seq.block_hashes, num_cached, num_cached + n, seq.hash_root)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self._prioritized:  # ahead of the waiting ones of its priority
            i = 0
            while i < len(self.waiting) and self.waiting[i].params.priority < seq.params.priority:
                i += 1
            self.waiting.insert(i, seq)
        else:
            self.waiting.appendleft(seq)

    def _preempt_for_priority(self) -> None:
        """The first waiting sequence takes the place of the lowest-priority running ones, newest
        first, while they rank below it and it could not start beside them: max_num_seqs running, or
        fewer free blocks than its prompt needs."""
        if not self.waiting:
            return
        head = self.waiting[0]
        need = self.bm.blocks_needed(min(len(head.token_ids), self.config.max_num_batched_tokens))
        running = self.running
        while running and running[-1].params.priority > head.params.priority and (
                len(running) >= self.config.max_num_seqs or self.bm.num_free_blocks < need):
            self._preempt(running[-1])

    def update(self, batch: Batch, samples: list[SampleOutput | None]) -> list[StepOutput]:
        """Advance the sequences of an executed batch and append their new tokens."""
        outputs = []
        bs = self.bm.block_size
        status_finished, status_running = SequenceStatus.FINISHED, SequenceStatus.RUNNING
        steps = batch.num_steps
        drafted = kept = 0
        for it, sample in zip(batch.items, samples):
            seq = it.seq
            seq.num_pending -= it.samples * steps
            if sample is not None and seq.status is not status_finished:
                if sample.prompt is not None:
                    seq.add_prompt_logprobs(it.start, sample.prompt)
                if sample.pooled is not None:
                    seq.add_pooled(it.start, sample.pooled)
            if seq.status is status_finished or not it.samples or sample is None:
                continue  # aborted or stopped while the step ran, or a prefill chunk that samples nothing
            token_ids = seq.token_ids
            new = [sample.token_id] if sample.more is None else [sample.token_id, *sample.more]
            draft = it.draft
            if draft is not None:  # the tokens that matched the draft, then the next one
                if seq.status is status_running:  # (a preempted one recomputes from its start)
                    seq.num_computed_tokens = it.start + len(new)  # the rejected positions' KV is not kept
                self.num_draft_tokens += len(draft)
                self.num_accepted_tokens += len(new) - 1
                drafted += 1
                kept += len(new)
            reason = None
            # a multi-step batch's (or a draft's) tokens in turn, until one ends the sequence (the rest are dropped)
            for j, token in enumerate(new):
                token_ids.append(token)
                end = it.end + j if draft is None else it.start + 1 + j
                if (it.num_new_tokens == 1 or draft is not None) and end % bs == 0 and seq.status is status_running:
                    # a decode, not preempted since, completed a block: schedule() could not register it
                    # if its input token was pending then (prefill chunks never have one)
                    self.bm.cache_blocks(seq.block_table, token_ids, seq.block_hashes, end - 1, end, seq.hash_root)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    del new[j + 1:]
                    break
            if reason is not None:
                self.finish(seq, reason)
            # positional: keyword arguments cost more than the rest of the call
            num_out = len(token_ids) - seq.num_prompt_tokens
            first = num_out == len(new)
            outputs.append(StepOutput(seq.seq_id, new, reason is not None, reason, "",
                                      [sample.logprob] if sample.logprob else [], None, seq.num_prompt_tokens,
                                      num_out, seq.num_cached_tokens, seq.take_prompt_logprobs() if first else None,
                                      seq.take_embedding() if first else None))
        if drafted:
            self.num_drafts += drafted
            weight = 1.0 - (1.0 - KEPT_WEIGHT) ** drafted
            self.kept_per_draft += weight * (kept / drafted - self.kept_per_draft)
        return outputs

    def discard(self, batch: Batch) -> None:
        """The batch was never computed: take back what its scheduling committed (the prefix-cache
        entries, the computed and pending counts)."""
        for it in batch.items:
            seq = it.seq
            seq.num_pending -= it.samples * batch.num_steps
            if seq.block_table and seq.status is SequenceStatus.RUNNING:
                self.bm.uncache(seq.block_table, it.start, it.end + batch.num_steps - 1)
                seq.num_computed_tokens = min(seq.num_computed_tokens, it.start)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in seq.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        num_tokens = len(seq.token_ids)
        if p.max_tokens is not None and num_tokens - seq.num_prompt_tokens >= p.max_tokens:
            return "length"
        if num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire seq (finished, stopped by a stop string, aborted, failed) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        if self.proposer is not None:
            self.proposer.drop(seq.seq_id)
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        if reason in ("stop", "length"):
            self._ended_prompt = ENDED_DECAY * self._ended_prompt + seq.num_prompt_tokens
            self._ended_output = ENDED_DECAY * self._ended_output + seq.num_output_tokens

    def abort(self, seq_id: int) -> bool:
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        self.finish(seq, "abort")
        return True

    def check_integrity(self) -> None:
        self.bm.check_integrity(s.block_table for s in self.running + list(self.waiting))
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in self.waiting)
