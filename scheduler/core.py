"""EngineCore: one step of the whole engine, shared by the offline LLM and the asyncio server
loop. schedule -> execute -> update -> detokenize -> outputs.

With an executor that can launch a step without waiting for it (a GPU runner), steps overlap:
step() schedules and launches step N+1 first, then waits for step N's tokens and does N's host
work (update, detokenize) while the GPU runs N+1. The outputs of a step come back from the next
call of step(). Torch-free: it talks to an Executor (the model runner) and a tokenizer it is given.

An executor of several pipeline stages (max_concurrent_batches > 1) runs a batch queue instead: up
to that many batches launched and not yet collected, each of sequences in no other one (a stage
works on one micro-batch while the next stage works on the one before), so no sequence has a token
pending on the device and none is chained to the step before. step() launches a batch while the
queue has room, and collects the oldest when it is full or nothing more could be scheduled.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from kvcache.block_manager import BlockManager
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.lora import LoraRegistry
from scheduler.token_bytes import token_bytes_table
from scheduler.trace import StepTrace
from scheduler.policy import Scheduler, SchedulerConfig
from scheduler.request import Batch, ExecutorLost, SampleOutput, SamplingParams, Sequence, StepOutput, next_seq_id

log = logging.getLogger("pagedserve")


class Executor(Protocol):
    def execute(self, batch: Batch) -> list[SampleOutput | None]: ...


class OverlapExecutor(Executor, Protocol):
    """An executor whose steps can be queued behind each other. launch() returns at once; a
    sequence with a pending token takes it from `prev`, the launch of the step before (on the
    device). collect() waits for a launched step's samples."""
    overlap: bool  # False: the core runs launch + collect back to back

    def launch(self, batch: Batch, prev: Any | None) -> Any: ...
    def collect(self, handle: Any) -> list[SampleOutput | None]: ...


class QueueExecutor(OverlapExecutor, Protocol):
    """Runs several batches at once, of disjoint sequences (pipeline stages): launch() is called
    with prev None, and up to max_concurrent_batches launches are collected in order."""
    max_concurrent_batches: int


@dataclass
class _InFlight:
    batch: Batch
    handle: Any


@dataclass
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_step_failures: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    max_in_flight: int = 0  # the most batches launched and not yet collected at once


class EngineCore:
    def __init__(self, executor: Executor | OverlapExecutor, tokenizer: Any, scheduler_config: SchedulerConfig,
                 num_blocks: int, block_size: int, eos_token_ids: frozenset[int]) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(num_blocks, block_size, scheduler_config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.loras = LoraRegistry(scheduler_config.lora_modules, int(getattr(executor, "lora_slots", 0)),
                                  scheduler_config.runtime_loras, getattr(executor, "load_lora", None),
                                  self.scheduler.loras)
        self.eos_token_ids = eos_token_ids
        self.detok: dict[int, IncrementalDetokenizer] = {}
        self.token_bytes = {True: token_bytes_table(tokenizer, True), False: token_bytes_table(tokenizer, False)}
        self.stats = EngineStats()
        self.lost: str | None = None  # why the executor can run no more steps (ExecutorLost), once it can't
        # batches launched and not yet collected, oldest first: with overlap, step N+1 is launched
        # (chained to N: its pending tokens are read on the device) before N is collected; a batch
        # queue holds up to max_concurrent_batches of disjoint sequences
        self._in_flight: deque[_InFlight] = deque()
        queue = int(getattr(executor, "max_concurrent_batches", 1))
        self._exclusive = queue > 1
        self._max_in_flight = queue if self._exclusive else 2 if self.overlaps else 1
        self.trace = StepTrace.from_env()
        if self.trace is not None and hasattr(executor, "enable_step_timing"):
            executor.enable_step_timing()

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    seq_id: int | None = None) -> Sequence:
        """Queue a request; raises RequestRejected (a ValueError) when it can never be served, and
        ExecutorLost once the executor is gone."""
        if self.lost is not None:
            raise ExecutorLost(self.lost)
        params = self.lora_params(params)
        seq = Sequence(seq_id if seq_id is not None else next_seq_id(), prompt_token_ids, params,
                       eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)
        self.scheduler.add(seq)
        self.detok[seq.seq_id] = IncrementalDetokenizer.for_params(self.tokenizer, params, self.token_bytes)
        return seq

    def lora_params(self, params: SamplingParams) -> SamplingParams:
        """params with the number of the LoRA adapter they name (UnknownAdapter if not loaded)."""
        if params.lora_name is None:
            return params
        return dataclasses.replace(params, lora=self.loras.number(params.lora_name))

    def load_lora(self, name: str, path: str = "", pinned: frozenset[str] = frozenset(), token: str = "") -> int:
        """A LoRA adapter's number, loading it where it is not loaded (scheduler/lora.py)."""
        return self.loras.load(name, path, self.loras_in_use(), pinned, token)

    def unload_lora(self, name: str) -> None:
        self.loras.unload(name, self.loras_in_use())

    def loras_in_use(self) -> set[int]:
        return {seq.params.lora for seq in self.scheduler.seqs.values()}

    def abort(self, seq_id: int) -> bool:
        self.detok.pop(seq_id, None)
        return self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._in_flight)

    def hold_wait(self) -> float:
        """Seconds the caller may sleep (waking for new requests) before the next step: nothing is
        on the device and new prompts are held for the rest of their burst (scheduler/policy.py)."""
        release = self.scheduler.hold_release
        if release is None or self._in_flight or self.scheduler.running:
            return 0.0
        return max(0.0, release - time.monotonic())

    @property
    def overlaps(self) -> bool:
        return bool(getattr(self.executor, "overlap", False))

    def step(self) -> list[StepOutput]:
        """One step's outputs. When the executor is lost (ExecutorLost), every request fails with
        its message and self.lost says why: the caller stops the engine."""
        try:
            if self.trace is None:
                return self._step()
            self.trace.begin()
            try:
                return self._step()
            finally:
                self.trace.end()
        except ExecutorLost as e:
            return self._lose(str(e))

    def close(self) -> None:
        """Release what the executor holds (tensor-parallel ranks); the core takes no more steps."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def _lose(self, message: str) -> list[StepOutput]:
        log.error("the engine can't go on: %s", message)
        self.lost = message
        self._in_flight.clear()
        return self._fail(list(self.scheduler.seqs.values()), message)

    def _step(self) -> list[StepOutput]:
        trace = self.trace
        queue = self._in_flight
        outputs: list[StepOutput] = []
        launched = False
        # a step that verifies drafts is collected before the next is scheduled: how many of its
        # tokens each sequence keeps decides where that sequence goes on
        if len(queue) < self._max_in_flight and (self._exclusive or not queue or not queue[-1].batch.has_drafts):
            before = self.scheduler.num_preemptions
            held = self.scheduler.num_held_steps
            if self._exclusive:
                batch = self._schedule_micro_batch()
            else:
                batch = self.scheduler.schedule()
            if trace is not None and batch is not None:
                # attended: query x key positions of the step's attention (its first model step);
                # cached: the positions each sequence reads from the KV cache (bench/trace_summary.py)
                items = batch.items
                trace.mark("t_sched", decodes=batch.num_decode, tokens=batch.num_tokens, seqs=len(items), steps=batch.num_steps,
                           held=self.scheduler.num_held_steps - held, cached=sum(it.start for it in items),
                           attended=sum(it.num_new_tokens * (it.start + (it.num_new_tokens + 1) / 2) for it in items))
            self.stats.num_preemptions += self.scheduler.num_preemptions - before
            if batch is not None:
                if self.block_manager.host is not None:
                    batch.kv_moves = self.block_manager.take_moves()
                self.stats.num_steps += 1
                if self.overlaps:
                    chained = queue[-1].handle if queue and not self._exclusive else None
                    try:
                        queue.append(_InFlight(batch, self.executor.launch(batch, chained)))
                        launched = True
                        if len(queue) > self.stats.max_in_flight:
                            self.stats.max_in_flight = len(queue)
                    except Exception as e:
                        outputs += self._step_failed(batch, e)
                    if trace is not None:
                        trace.mark("t_launch")
                else:
                    assert not queue
                    try:
                        samples = self.executor.execute(batch)
                    except Exception as e:
                        return self._step_failed(batch, e)
                    return self._process(batch, samples)
        # the oldest batch's tokens: once the queue is full, or when nothing more went out
        prev = queue.popleft() if queue and (len(queue) >= self._max_in_flight or not launched) else None
        if prev is not None:
            try:
                samples = self.executor.collect(prev.handle)
            except Exception as e:
                return outputs + self._step_failed(prev.batch, e)
            if trace is not None:
                # the collected step was launched by the previous row: trace_summary moves these there
                times = self.executor.gpu_times(prev.handle) if hasattr(self.executor, "gpu_times") else None
                trace.mark("t_collect", **({} if times is None else {"prev_gpu_ms": times[0], "prev_idle_ms": times[1]}))
            outputs += self._process(prev.batch, samples)
            outputs += self._finish_launched()
        return outputs

    def _finish_launched(self) -> list[StepOutput]:
        """Tell the executor the tokens just processed are known: a launched step whose sampling
        waited for them (constrained rows' masks, engine/runner.py finish()) queues it now, while
        its forward still runs. A failure there fails that step's requests."""
        finish = getattr(self.executor, "finish", None)
        outputs: list[StepOutput] = []
        if finish is None:
            return outputs
        for f in list(self._in_flight):
            try:
                finish(f.handle)
            except Exception as e:
                self._in_flight.remove(f)
                outputs += self._step_failed(f.batch, e)
        return outputs

    def _schedule_micro_batch(self) -> Batch | None:
        """A batch queue's next batch: of sequences in no batch in flight, and at most its share of
        the unfinished ones (the rest go to the next batches), so every stage gets work."""
        busy = {it.seq.seq_id for f in self._in_flight for it in f.batch.items}
        return self.scheduler.schedule_micro_batch(busy, self._max_in_flight)

    def _step_failed(self, batch: Batch, e: Exception) -> list[StepOutput]:
        """A fault in the model step fails this step's requests, not the engine (unless it is
        ExecutorLost: step() then fails them all)."""
        if isinstance(e, ExecutorLost):
            raise e
        log.exception("model step failed; failing %d requests", len(batch.items), exc_info=e)
        self.stats.num_step_failures += 1
        if batch.kv_moves is not None:
            self.block_manager.moves_failed(batch.kv_moves)
        self.scheduler.discard(batch)
        return self._fail([it.seq for it in batch.items], f"internal error during generation ({type(e).__name__})")

    def _process(self, batch: Batch, samples: list[SampleOutput | None]) -> list[StepOutput]:
        outputs = self.scheduler.update(batch, samples)
        if not outputs:
            return outputs
        now = time.monotonic()
        seqs = {it.seq.seq_id: it.seq for it in batch.items}
        detoks, stats = self.detok, self.stats
        new_tokens = 0
        for out in outputs:
            new_tokens += len(out.new_token_ids)
            seq = seqs[out.seq_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
                stats.prompt_tokens += seq.num_prompt_tokens
            detok = detoks[out.seq_id]
            ids = out.new_token_ids
            if out.finish_reason == "stop" and not seq.params.include_stop_str_in_output:
                ids = ids[:-1]  # a stop token (end-of-sequence, stop_token_ids) is not the text's, as in vLLM
            out.new_text = detok.add(ids, out.finished)
            if detok.stopped and not out.finished:
                self.scheduler.finish(seq, "stop")
                out.finished, out.finish_reason = True, "stop"
            if out.finished:
                del detoks[out.seq_id]
        stats.generation_tokens += new_tokens
        return outputs

    def _fail(self, seqs: list[Sequence], message: str) -> list[StepOutput]:
        outputs = []
        for seq in seqs:
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, "error")
            self.detok.pop(seq.seq_id, None)
            outputs.append(StepOutput(seq.seq_id, [], True, "error", error=message,
                                      num_prompt_tokens=seq.num_prompt_tokens,
                                      num_output_tokens=seq.num_output_tokens))
        return outputs
