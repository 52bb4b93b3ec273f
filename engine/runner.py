"""ModelRunner: Batch -> input tensors + attention metadata -> logits -> sampled tokens.

Implements the scheduler's Executor protocol. Holds the model, the KV pool and the op set.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.attention import AttnMetadata, Ops, reference_ops
from engine.config import AUTO_SCHEDULER_STEPS, EngineConfig, ModelConfig
from engine.cost_model import CHUNK as COST_CHUNK, MAX_ROWS as COST_MAX_ROWS, StepCostModel
from engine.cuda_graph import DecodeGraphs, graph_buckets, head_words, smallest_bucket
from engine.draft import DraftModel, Proposed, catch_up_chunks
from engine.grammar_mask import GrammarMasks, apply_token_bitmask
from engine.logit_adjust import LogitAdjuster
from engine.lora import TARGETS, LoraError, LoraMasks, attach, load_adapter
from engine.loader import init_dummy_weights, load_weights
from engine.models.llama import LlamaForCausalLM, rope_cos_sin
from engine.parallel.topology import Stage
from engine.parallel.comm import Comm
from engine.parallel.graph_memory import NCCL_BYTES_PER_CAPTURE, nccl_captures
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.topology import Pipe, Sent
from engine.piecewise import PiecewiseGraphs
from engine.quant import AT_LOAD
from engine.pooling import PooledSamples, pooled_spans
from engine.prompt_logprobs import PromptRows, PromptSamples, compute_prompt_logprobs, prompt_rows
from engine.sampler import DeviceSamples, HostSlots, SamplingBatch, sample_on_device
from engine.step_graph import StepGraphs, graph_token_limits, graphed_token_counts, step_buckets
from engine.upload import HostInputs, UploadRing, take_pending
from kvcache.calc import (cpu_kv_blocks, estimate_graph_bytes, estimate_piecewise_graph_bytes, estimate_step_graph_bytes,
                          kv_cache_bytes)
from kvcache.host_pool import HostKVPool, KVCopier
from kvcache.host_tier import host_tier_blocks
from kvcache.pool import KVPool
from kvcache.spec import KVCacheSpec, resolve_kv_dtype
from scheduler.request import Batch, SampleOutput, SamplingParams, ScheduledSeq, startup_lora_slots

log = logging.getLogger("pagedserve")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torch.cuda._sleep spins this many ms per unit at ~2 GHz (an H100 boosts to 1.98 GHz)
SLEEP_MS_PER_UNIT = 5e-7
# The start-up cost model times a forward this many times the smallest one's, a compute-bound one,
# with the GPU at its power limit, after HEAT_MS of matmuls: an H100 held there lowers its clocks
# ~15% within a second, and a served step with many prompt tokens runs at that limit, where a cold
# GPU's burst had timed it 10-25% short (bench/NOTES.md, 2026-11-27)
HOT_ABOVE = 1.25
HEAT_MS = 400.0


def available_ram_bytes() -> int:
    """RAM the system can give without swapping (Linux: MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _device_ms(fn: Callable[[], object], repeats: int = 3, comm: Comm | None = None,
               head: Callable[[float], None] | None = None) -> float:
    """Median device time of fn's kernels, ms. A sleep kernel queued first keeps the GPU busy while
    the host queues fn, so host launch gaps don't count (the graphs replay without them). Where fn
    itself waits for the device (a host sync inside), no head start helps: it is timed as it runs.
    The first call, which may compile, is not timed. comm (tensor parallel): fn's collectives wait
    for every rank, so all ranks call fn equally often, sleep equally long and start together.
    head(ms): queues that head start itself instead of the sleep (_Heater.run: matmuls, so that fn
    finds the GPU at its power limit)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    comm = comm or Comm()

    def once(lead_ms: float) -> tuple[float, float]:
        torch.cuda.synchronize()
        comm.barrier()
        if lead_ms:
            if head is None:
                torch.cuda._sleep(int(lead_ms / SLEEP_MS_PER_UNIT))
            else:
                head(lead_ms)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        queued_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        return start.elapsed_time(end), queued_ms

    fn()
    torch.cuda.synchronize()
    comm.barrier()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3  # queueing fn (or running it, if it waits for the device)
    # a head start the host won't use up (the slowest rank's), in whole microseconds
    lead_ms = comm.max_int(int((1.5 * host_ms + 1.0) * 1e3)) / 1e3
    return device_median(once, lead_ms, repeats, lambda flag: bool(comm.max_int(int(flag))))


LEAD_GROWTH = 8.0  # a head start that the host used up is tried again this many times longer


def device_median(once: Callable[[float], tuple[float, float]], lead_ms: float, repeats: int,
                  anywhere: Callable[[bool], bool] = bool) -> float:
    """The median of `repeats` device times of once(lead_ms) -> (device ms, host ms spent queueing).
    A sample whose queueing used up most of its head start (on any rank: anywhere) let the device
    wait for the host's launches: it is taken again with a longer head start, which the samples
    after it keep, so that a host slowed for a while (the start-up's compile threads hold the GIL)
    still times the device alone. Falling back to no head start there timed the host instead (one
    H100 start-up measured Llama-3-8B's 256-row forward at 29.6 ms against 8.4; bench/NOTES.md,
    2026-11-27). A fn that waits for the device itself uses up the longer head start too: it is
    timed as it runs, without one."""
    samples: list[float] = []
    while len(samples) < repeats:
        device_ms, queued_ms = once(lead_ms)
        if lead_ms > 0 and anywhere(queued_ms >= 0.8 * lead_ms):
            longer = lead_ms * LEAD_GROWTH
            device_ms, queued_ms = once(longer)
            if anywhere(queued_ms >= 0.8 * longer):
                lead_ms = 0.0
                device_ms = once(0.0)[0]
            else:
                lead_ms = longer
        samples.append(device_ms)
    return float(np.median(samples))


class _Heater:
    """Back-to-back bf16 matmuls that hold the GPU at its power limit for a given time; every rank
    queues as many (the slowest rank's rate), so that the ranks stay in step."""

    N = 4096

    def __init__(self, device: torch.device, comm: Comm) -> None:
        self.a = torch.randn(self.N, self.N, dtype=torch.bfloat16, device=device)
        self.b = torch.randn_like(self.a)
        self.out = torch.empty_like(self.a)
        for _ in range(3):
            self._product()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            self._product()
        end.record()
        end.synchronize()
        # the burst's time: under the power limit a product takes longer, so the head start only grows
        self.us_each = max(1, comm.max_int(int(start.elapsed_time(end) * 100)))

    def _product(self) -> None:
        torch.matmul(self.a, self.b, out=self.out)

    def run(self, ms: float) -> None:
        for _ in range(max(1, int(ms * 1e3 / self.us_each) + 1)):
            self._product()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is visible; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, model_cfg: ModelConfig, device: torch.device) -> str:
    """auto: the checkpoint's dtype on a GPU; float32 on the CPU, where half precision is slow."""
    if dtype != "auto":
        return dtype
    return model_cfg.torch_dtype if device.type == "cuda" else "float32"


def select_ops(device: torch.device, backend: str, pdl: bool | None = None) -> tuple[Ops, bool]:
    """Triton kernels on a GPU, the torch reference on the CPU (or wherever asked for) -> (ops,
    whether they use PDL). pdl: the Triton kernels launch with programmatic dependent launch
    (kernels/pdl.py); None: where the device can (measured faster on an H100, bench/NOTES.md)."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        if pdl:
            raise ValueError("pdl (programmatic dependent launch) needs the Triton kernels on a CUDA GPU")
        return reference_ops(), False
    from kernels import require_triton

    require_triton()
    from engine.triton_ops import triton_ops
    from kernels.pdl import supported
    why = supported(device)
    if pdl and why is not None:
        raise ValueError(why)
    pdl = why is None if pdl is None else pdl
    return triton_ops(pdl), pdl


def _sampling_batch(items: list[ScheduledSeq], sampled: list[int]) -> SamplingBatch:
    """The sampling parameters of the items that sample, with the output position of the token
    each samples (which counts pending tokens, unlike num_output_tokens); an item that verifies a
    draft samples at each of its positions, as many rows (a seeded row's token at an output position
    is the one it would be without the draft)."""
    params, positions = [], []
    for i in sampled:
        it = items[i]
        if it.draft is None:
            params.append(it.seq.params)
            positions.append(it.end - it.seq.num_prompt_tokens)
        else:
            first = it.start + 1 - it.seq.num_prompt_tokens
            params += [it.seq.params] * it.num_new_tokens
            positions += range(first, first + it.num_new_tokens)
    return SamplingBatch(params, positions)


def _logit_rows(it: ScheduledSeq) -> int:
    """The rows of logits a sampling item takes: one, or each position of a draft's item."""
    return 1 if it.draft is None else it.num_new_tokens


def _logit_items(items: list[ScheduledSeq], sampled: list[int]) -> list[ScheduledSeq]:
    """The item of each row of logits a step samples (_sampling_batch's rows)."""
    return [items[i] for i in sampled for _ in range(_logit_rows(items[i]))]


def _attach(outputs: list[SampleOutput | None], found: dict[int, Any], field: str) -> None:
    """A step's results beside its tokens (prompt logprobs, pooled rows), by item, onto the item's
    output; an item that samples nothing gets one of its own (token -1)."""
    for i, value in found.items():
        if outputs[i] is None:
            outputs[i] = SampleOutput(-1, **{field: value})
        else:
            setattr(outputs[i], field, value)


def accepted(rows: list[int], draft: list[int]) -> list[int]:
    """A verified draft's tokens: rows[j] sampled after the input's j-th token (the last known one,
    then the draft's); each draft token stands while it equals the token sampled before it, and the
    first that does not is replaced by that sample. The result is drawn as without the draft: where a
    draft token equals the sample, the model's next position saw the token it would have."""
    n = 0
    while n < len(draft) and rows[n] == draft[n]:
        n += 1
    return rows[:n + 1]


@dataclass
class Launched:
    """A step queued on the device: its samples (still on the device) and, per sampling
    sequence, its row in them, where the next step's input ids are read from."""
    samples: DeviceSamples | None
    rows: dict[int, int]  # seq_id -> row of samples.tokens
    sampled: list[int]  # indices of the batch items that sample
    num_items: int
    events: tuple | None = None  # CUDA timing events around the step (enable_step_timing)
    sent: Sent | None = None  # a pipeline stage's carry on its way to the next stage
    deferred: DeferredSample | None = None  # constrained rows' sampling, waiting for finish()
    prompt: PromptSamples | None = None  # prompt logprobs of the step's chunks (engine/prompt_logprobs.py)
    pooled: PooledSamples | None = None  # embedding requests' pooled rows (engine/pooling.py)
    # speculative decoding: per sampling item, its first row of samples and its draft (None: one row)
    drafts: list[tuple[int, list[int] | None]] | None = None
    proposed: Proposed | None = None  # a draft model's drafts (engine/draft.py), on the device


@dataclass
class DeferredSample:
    """The sampling of a step with constrained rows whose previous token was still pending at
    launch: queued by finish() once that token is on the host and their masks can be filled."""
    logits: torch.Tensor
    sbatch: SamplingBatch
    items: list[ScheduledSeq]  # the sampling rows, in order
    tokens_out: torch.Tensor | None  # where a decode graph that follows reads its pending input tokens


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Storage, uninitialised, for a model built on the meta device: every floating parameter and
    buffer in dtype, on device (a tensor shared by two modules stays shared). Module.to_empty() does
    this through torch._refs, whose first use imports sympy, and on the GPU machines torch._dynamo
    with it: seconds of start-up."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    # quantized weights and their scales (engine/quant.py) keep their dtypes
                    keep = not t.is_floating_point() or t.dtype == torch.float8_e4m3fn or name == "weight_scale"
                    new = torch.empty(t.shape, dtype=t.dtype if keep else dtype, device=device)
                    made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                table[name] = made[id(t)]
    return model


def build_model(model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig, device: torch.device,
                dtype: torch.dtype, max_model_len: int, show_progress: bool = True, comm: Comm | None = None,
                stage: Stage | None = None) -> LlamaForCausalLM:
    """The model on the device with its weights (dummy ones with load_format "dummy"), ready to run."""
    with torch.device("meta"):
        model = LlamaForCausalLM(model_cfg, comm, stage, cfg.enable_expert_parallel,
                                 model_cfg.quant or (AT_LOAD if cfg.quantization == "fp8" else None))
    model = materialize(model, device, dtype)
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
    else:
        assert model_path is not None
        load_weights(model, model_path, show_progress)
    model.fold_act_orders()
    model.cos_sin = rope_cos_sin(model_cfg, max_model_len, device)
    return model.eval()


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, model_path: Path | None, cfg: EngineConfig,
                 max_model_len: int, show_progress: bool = True, tp: TPGroup = SINGLE, pp: Pipe | None = None,
                 draft: tuple[ModelConfig, Path | None] | None = None) -> None:
        """draft: speculative decoding's draft model (engine/draft.py), its config and folder: on rank
        0 only under tensor parallelism (it sends the other ranks its drafts)."""
        self.model_cfg = model_cfg
        self.cfg = cfg
        # tp: this rank's place in the tensor-parallel group; every rank runs this same start-up, whose
        # collectives (forwards, agreed sizes) must come in the same order on each
        self.comm = Comm(tp)
        # pp: this rank's pipeline stage (its layers, where its carry comes from and goes to); None: the whole model
        self.pipe = pp
        self.device = resolve_device(cfg.device)
        if (tp.size > 1 or pp is not None) and self.device.type == "cuda":
            self.device = torch.device("cuda", tp.local_rank)
        self.dtype_name = resolve_dtype(cfg.dtype, model_cfg, self.device)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // cfg.block_size)
        self._rows: dict[int, list] = {}  # seq_id -> [block table list, its row index in _row_store, entries filled]
        self.ops, self.pdl = select_ops(self.device, cfg.backend, cfg.pdl)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.grammar: GrammarMasks | None = None  # constrained decoding: set up by serve/build.py
        self.adjuster = LogitAdjuster()  # penalties, logit_bias, min_p, min_tokens (engine/logit_adjust.py)
        # Overlap (async scheduling) pays where launches return before the work is done: on a GPU.
        self.overlap = self.device.type == "cuda" if cfg.async_scheduling is None else cfg.async_scheduling

        log.debug("start-up: building the model runner")
        clock = time.perf_counter()
        self.startup_s: dict[str, float] = {}  # start-up phase -> seconds, in order (serve/build.py logs them)

        self.free_bytes_after_phase: dict[str, int] = {}  # GPU: what each phase left free (kv-calc --measure)

        def phase(name: str) -> None:
            nonlocal clock
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self.free_bytes_after_phase[name] = torch.cuda.mem_get_info(self.device)[0]
            now = time.perf_counter()
            self.startup_s[name] = now - clock
            clock = now

        self.model = model = build_model(model_cfg, model_path, cfg, self.device, self.dtype, max_model_len,
                                         show_progress, self.comm, None if pp is None else pp.stage)
        # LoRA adapters (engine/lora.py): which adapter each token uses, set before each step
        self.lora: LoraMasks | None = None
        self._lora_uploads: UploadRing | None = None
        self._lora_used = False  # a token of the step being launched uses an adapter
        self.lora_slot_of: dict[int, int] = {}  # SamplingParams.lora -> its adapter's slot
        if cfg.lora_modules or cfg.enable_lora:
            self._attach_lora()
        phase("weights")
        if tp.size > 1 and self.device.type == "cuda" and not cfg.disable_custom_all_reduce:
            why_not = self.comm.use_peer_memory(self.device)  # a collective: every rank, here
            if why_not is None and cfg.backend != "torch":  # the Triton kernels: the all-reduce fused with the norm
                self.comm.fuse_norm(model_cfg.hidden_size, self.dtype, self.pdl)
            if self.comm.rank == 0:
                one_shot, fused = self.comm.peer_limits()
                log.info("tensor parallel: all-reduces in CUDA graphs %s", f"over NVLink peer memory (one-shot up to "
                         f"{one_shot >> 20} MiB, fused with the norm up to {fused >> 20} MiB)"
                         if why_not is None else f"through NCCL ({why_not})")

        self.weight_bytes: int | None = None  # measured on a GPU when the pool is sized from free memory
        self.activation_bytes: int | None = None  # the profile run's peak beyond the weights, plus outside_torch_bytes
        self.outside_torch_bytes: int | None = None  # the CUDA context, NCCL's buffers, other processes
        kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype_name)
        self.kv_spec = KVCacheSpec.for_model(model.stage.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                                             cfg.block_size, kv_dtype, tp.size)
        self.draft: DraftModel | None = None
        spec = cfg.speculative_config
        # every rank's steps take a draft model's tokens, which rank 0's draft model proposes
        self.model_drafts = spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        if draft is not None:
            if pp is not None:
                raise ValueError("a draft model with pipeline parallelism is not supported yet; use n-gram drafts "
                                 "({\"method\": \"ngram\", ...}) or tensor parallelism")
            assert spec is not None and self.comm.rank == 0
            draft_cfg, draft_path = draft
            self.draft = DraftModel(
                build_model(draft_cfg, draft_path, cfg, self.device, self.dtype, max_model_len, show_progress),
                self.ops, spec.num_speculative_tokens,
                KVCacheSpec.for_model(draft_cfg.num_layers, draft_cfg.num_kv_heads, draft_cfg.head_dim, cfg.block_size,
                                      kv_dtype, 1))
            phase("draft model")
        # the step cost model (GPU): the scheduler's prompt budget, the graphs' largest mixed step;
        # every rank derives its graphs from it: rank 0's measurement for all. A start that measures
        # compiles the Triton kernels of every phase meanwhile, on threads.
        self.cost_model = self.step_costs(early=self._compile_early) if self.device.type == "cuda" else None
        if self.cost_model is not None:
            phase("cost model")
        # a pipeline stage's decode and piecewise graphs cover its layers (the carry's receive and
        # send stay outside them); it has no whole-step graphs and runs no multi-step rounds
        graphs = self.device.type == "cuda" and not cfg.enforce_eager
        # decode steps per scheduling round: multi-step rounds replay the decode graphs; by default
        # only where the host's work per round is a large share of a decode step (a small model);
        # never with drafts (each needs its sequence's last token on the host)
        self.num_scheduler_steps = 1
        if graphs and pp is None and cfg.speculative_config is None:
            self.num_scheduler_steps = cfg.num_scheduler_steps or (
                self.cost_model.scheduler_steps(min(64, cfg.max_num_seqs), AUTO_SCHEDULER_STEPS)
                if self.cost_model is not None else AUTO_SCHEDULER_STEPS)
        # stall-free batching (the scheduler's prompt budget) where the GPU's step sets the pace, or
        # where the user states a step target; a host-bound model keeps large prompt steps and
        # multi-step decode rounds, which serve it faster (bench/NOTES.md, 2026-11-25)
        self.prompt_budget = (self.cost_model.prompt_budget if self.cost_model is not None
                              and (self.num_scheduler_steps == 1 or cfg.max_step_ms is not None) else None)
        # the largest step with prefill tokens that the piecewise graphs replay, and the whole-step
        # graphs' (a pipeline stage has none)
        self.piecewise_max_tokens, self.step_max_tokens = graph_token_limits(
            self.cost_model, self.prompt_budget is not None, cfg.max_num_batched_tokens, cfg.step_graph_max_tokens,
            cfg.max_num_seqs, tp.size, self.ops.work_lists and pp is None)
        # the scheduler's blocks must exist on every rank: the fewest any rank can hold
        self.num_blocks = self.comm.min_int(cfg.num_kv_blocks or self._auto_num_blocks())
        if pp is not None:  # and on every stage (each holds its own layers' KV in as many blocks)
            self.num_blocks = pp.comm.min_int(self.num_blocks)
        self.pool = KVPool(self.kv_spec, self.num_blocks, self.device, self.dtype)
        if self.draft is not None:
            self.draft.allocate(self.num_blocks, self.device, self.dtype)
        phase("kv cache")
        self.offload: KVCopier | None = None  # the host tier's copies (kvcache/host_pool.py)
        self.host_blocks = 0
        if cfg.kv_offload_gib:
            self._build_host_tier(cfg.kv_offload_gib)
            phase("host kv tier")
        # Eager steps read block tables from this full-width buffer (the decode kernel's split plan
        # depends on the width); each step uploads only the columns its sequences use.
        self.block_tables = torch.zeros((cfg.max_num_seqs, self.max_blocks_per_seq), dtype=torch.int32, device=self.device)
        self._step_timing = False  # enable_step_timing()
        self._last_end: torch.cuda.Event | None = None
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.steps: StepGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.ops, self.pool.layers, cfg.max_num_seqs,
                                       self.max_blocks_per_seq, cfg.block_size, self.device, self.num_scheduler_steps)
            if cfg.piecewise_graphs:
                self.piecewise = PiecewiseGraphs(self.model, self.ops, self.pool.layers, self.piecewise_max_tokens,
                                                 self.device, self._slow_buckets(), fine_above=self.step_max_tokens)
                if self.step_max_tokens > 0:
                    self.steps = StepGraphs(self.model, self.ops, self.pool.layers, self.piecewise, cfg.max_num_seqs,
                                            self.max_blocks_per_seq, self.step_max_tokens, self.device,
                                            self._slow_buckets())
        if self.device.type == "cuda":
            self._compile_ahead()
            phase("compiles")
        if self.graphs is not None:
            self.graphs.capture(self.lora.detached if self.lora is not None else None)
            phase("decode graphs")
            if self.piecewise is not None:
                self.piecewise.capture()
                phase("piecewise graphs")
                if self.steps is not None:
                    self.steps.capture(self.piecewise.pool)
                    phase("step graphs")
            if self.draft is not None:
                self.draft.capture(cfg.max_num_seqs, self.max_blocks_per_seq, self.device)
                phase("draft graphs")
        self.host_slots: HostSlots | None = None
        self.uploads: UploadRing | None = None
        if self.device.type == "cuda":
            self.host_slots = HostSlots(cfg.max_num_seqs * self.num_scheduler_steps)
            # prepare()'s largest upload: int64 ids, positions, slots per token and 3 words per
            # sequence; int32 3 words per sequence, 2 more and the block tables
            tokens, seqs = max(cfg.max_num_batched_tokens, cfg.max_num_seqs), cfg.max_num_seqs
            self.uploads = UploadRing(8 * (3 * tokens + 3 * seqs) + 4 * (3 * seqs + 2 + seqs * self.max_blocks_per_seq))
            self.warmup()
            from kernels.launch import finish_compiles

            finish_compiles()  # anything the early pass compiled that no phase launched
            phase("warm-up")
            self._check_budget()
        # speculative decoding's gate (scheduler/policy.py _drafts_pay): rank 0's scheduler asks
        self.speculation_ratio: Callable[[int], float] | None = None
        if spec is not None and self.cost_model is not None and self.comm.rank == 0 and pp is None:
            self.speculation_ratio = self._speculation_ratio(spec.num_speculative_tokens)

    def _speculation_ratio(self, k: int) -> Callable[[int], float]:
        """(sequences) -> a step in which they all take k draft tokens against one in which they decode:
        the forward of k + 1 rows a sequence (the cost model's) and, with a draft model, its round of
        k + 1 decode steps for that many rows (its graphs, timed here), against the forward of one
        row a sequence."""
        cost = self.cost_model
        assert cost is not None
        rounds: dict[int, float] = {}
        if self.draft is not None and self.draft.graphs is not None:
            rounds = self.draft.time_rounds(_device_ms)
        buckets = sorted(rounds)

        def ratio(seqs: int) -> float:
            draft_ms = rounds[smallest_bucket(buckets, seqs) or buckets[-1]] if buckets else 0.0
            return (cost.forward(seqs * (k + 1)) + draft_ms) / cost.forward(seqs)

        if rounds:
            log.info("draft model: a round of %d steps takes %s ms at %s rows", k + 1,
                     "/".join(f"{rounds[b]:.2f}" for b in buckets[:4]), "/".join(map(str, buckets[:4])))
        return ratio

    def _attach_lora(self) -> None:
        cfg, model_cfg = self.cfg, self.model_cfg
        if model_cfg.num_experts:
            raise LoraError("LoRA adapters of a mixture-of-experts model are not supported yet")
        if getattr(model_cfg.quant, "act_order", False):
            raise LoraError("LoRA adapters on a 4-bit checkpoint in activation order are not supported yet; "
                            "serve a checkpoint without act-order (desc_act) or a 16-bit one")
        adapters = [load_adapter(name, path, model_cfg) for name, path in cfg.lora_modules]
        ranks = [a.rank for a in adapters]
        if cfg.max_lora_rank and ranks and max(ranks) > cfg.max_lora_rank:
            raise LoraError(f"LoRA adapter {adapters[ranks.index(max(ranks))].name!r} has rank {max(ranks)}, more than "
                            f"max_lora_rank {cfg.max_lora_rank}")
        if cfg.enable_lora:  # any adapter may come later: every projection, vLLM's default sizes
            slots = max(cfg.max_loras or 1, len(adapters))
            rank = max([cfg.max_lora_rank or 16] + ranks)
            targets = frozenset(TARGETS)
        else:
            slots, rank = len(adapters), max(ranks)
            targets = frozenset(t for a in adapters for _, t in a.weights)
        drafts = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config is not None else 0
        tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs * (1 + drafts), COST_MAX_ROWS)
        self.lora = attach(self.model, slots, rank, targets, tokens, self.device, self.dtype)
        self.lora_slot_of = startup_lora_slots(len(adapters))
        for slot, adapter in enumerate(adapters):
            self.lora.write(slot, adapter)
        if self.device.type == "cuda":
            self._lora_uploads = UploadRing(8 * tokens, slots=4)
        log.info("LoRA: %d adapter slots of rank up to %d%s", slots, rank,
                 f"; loaded {', '.join(a.name for a in adapters)}" if adapters else "")

    @property
    def lora_slots(self) -> int:
        """How many LoRA adapters the engine holds at once (0: none)."""
        return 0 if self.lora is None else self.lora.slots

    def load_lora(self, slot: int, lora_id: int, name: str, path: str) -> None:
        """The adapter at path into slot, for requests with SamplingParams.lora = lora_id (the
        adapter there before is gone, and so is its id). LoraError where it does not fit. The
        copies queue behind the steps launched before, which read the slot as it was."""
        if self.lora is None:
            raise LoraError("this engine has no LoRA adapter slots; start it with enable_lora")
        self.lora.write(slot, load_adapter(name, path, self.model_cfg))
        self.lora_slot_of = {i: s for i, s in self.lora_slot_of.items() if s != slot}
        self.lora_slot_of[lora_id] = slot

    def _lora_inputs(self, items: list[ScheduledSeq]) -> None:
        """The LoRA masks of a step: each token's adapter slot (lora_slot_of its SamplingParams.lora),
        in the token order every input layout shares (an item's tokens together, items in order)."""
        lora = self.lora
        if lora is None:
            return
        loras = [it.seq.params.lora for it in items]
        self._lora_used = any(loras)
        if not self._lora_used:
            lora.set(None)
            return
        slot_of = self.lora_slot_of
        per_token = np.repeat(np.array([slot_of[i] if i else -1 for i in loras], dtype=np.int64),
                              [it.num_new_tokens for it in items])
        n = len(per_token)
        ring = self._lora_uploads
        if ring is None:
            slots = torch.from_numpy(per_token)
        else:
            slots = torch.empty(n, dtype=torch.int64, device=self.device)
            ring.buffer()[:8 * n] = per_token.view(np.uint8)
            ring.send(slots.view(torch.uint8), 8 * n)
        lora.set(slots)

    def _check_budget(self) -> None:
        """Say so when start-up ended past the memory budget: the pool was sized from estimates of
        what the graphs would take (under TP, before NCCL's share was counted, their capture took
        1-2.7 GB more: bench/NOTES.md, 2026-11-26)."""
        if self.cfg.num_kv_blocks:
            return  # the user sized the pool
        free, total = torch.cuda.mem_get_info(self.device)
        over = int(total * (1 - self.cfg.gpu_memory_utilization)) - free
        if over > 64 * 2**20:
            log.warning("GPU %d: start-up used %.2f GiB more than --gpu-memory-utilization %.2f allows (the CUDA "
                        "graphs took more than reserved); %.2f GiB of the GPU is still free",
                        self.device.index or 0, over / 2**30, self.cfg.gpu_memory_utilization, free / 2**30)

    def _build_host_tier(self, gib: float) -> None:
        """The host pool of kv_offload_gib GiB (pinned where CUDA is available) and its copier."""
        nbytes = int(gib * (1 << 30))
        # every rank (tensor/pipeline parallel) keeps its own shard: the scheduler's slots must exist on
        # each, and the ranks of this host pin theirs together (all check before any pins)
        pp_comm = self.pipe.comm if self.pipe is not None else None
        blocks = self.comm.min_int(host_tier_blocks(gib, self.kv_spec.bytes_per_block))
        self.host_blocks = pp_comm.min_int(blocks) if pp_comm is not None else blocks
        if self.host_blocks < 1:
            raise ValueError(f"kv_offload_gib {gib} holds no KV block ({self.kv_spec.bytes_per_block} bytes each); "
                             "raise it or leave it 0")
        ram = available_ram_bytes()
        ranks = self.cfg.tensor_parallel_size * self.cfg.pipeline_parallel_size
        fits = self.comm.min_int(int(nbytes * ranks <= 0.9 * ram))
        fits = pp_comm.min_int(fits) if pp_comm is not None else fits
        if not fits:
            raise ValueError(f"kv_offload_gib {gib}{f' x {ranks} ranks' if ranks > 1 else ''} is more than 90% of "
                             f"the {ram / (1 << 30):.1f} GiB of RAM available; lower --kv-offload-gib")
        host = HostKVPool(self.pool, self.host_blocks, pin=self.device.type == "cuda")
        self.offload = KVCopier(self.pool, host)
        log.info("host KV tier: %d blocks (%d tokens, %.1f GiB)", self.host_blocks,
                 self.host_blocks * self.kv_spec.block_size, host.nbytes / (1 << 30))

    @torch.inference_mode()
    def _compile_early(self) -> None:
        """Submit the compiles of every start-up phase's Triton kernels at once, to run on threads
        while the cost model and the KV sizing run: a dry pass (kernels/launch.py) over the cost
        model's forwards, the profile run's and the warm-up's, and over graphs of a provisional size
        (the final sizes follow from the cost model; _compile_ahead() catches what this missed)."""
        from kernels.launch import compile_ahead

        cfg = self.cfg
        pool = KVPool(self.kv_spec, 1, self.device, self.dtype)
        with compile_ahead(wait=False):
            for n in self._cost_sizes():
                self._forward_fn(n, pool)()
            self.profile_run(sample=False)
            if not cfg.enforce_eager:
                DecodeGraphs(self.model, self.ops, pool.layers, cfg.max_num_seqs, self.max_blocks_per_seq,
                             cfg.block_size, self.device, 1).dry_run()
                if cfg.piecewise_graphs:  # their pieces' kernels are the cost model forwards'
                    top = min(cfg.max_num_batched_tokens, max(cfg.step_graph_max_tokens, COST_MAX_ROWS))
                    pw = PiecewiseGraphs(self.model, self.ops, pool.layers, top, self.device, frozenset())
                    if cfg.step_graph_max_tokens and self.ops.work_lists and self.pipe is None:
                        StepGraphs(self.model, self.ops, pool.layers, pw, cfg.max_num_seqs, self.max_blocks_per_seq,
                                   min(cfg.step_graph_max_tokens, top), self.device, frozenset()).dry_run()
            self.warmup(sample=False, layers=pool.layers, eager_decodes=cfg.enforce_eager)
        del pool
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def _compile_ahead(self) -> None:
        """The Triton kernels of the graphs' final sizes that the early pass did not cover, compiled
        side by side on threads before capture compiles them one after another."""
        from kernels.launch import compile_ahead

        with compile_ahead() as compiled:  # the decode graphs' and warm-up's sizes are the early pass's
            for graphs in (self.piecewise, self.steps):
                if graphs is not None:
                    graphs.dry_run()
        torch.cuda.synchronize(self.device)
        if compiled and compiled[0]:
            log.info("compiled %d kernel variants ahead of capture", compiled[0])

    def _slow_buckets(self) -> frozenset[int]:
        """Token counts not worth a graph: a larger count's forward measured faster."""
        return self.cost_model.dominated if self.cost_model is not None else frozenset()

    def _auto_num_blocks(self) -> int:
        if self.device.type != "cuda":
            return cpu_kv_blocks(self.kv_spec, self.cfg.max_num_seqs, self.max_model_len, available_ram_bytes())
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)  # CUDA context, other processes
        weights = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        self.activation_bytes = torch.cuda.max_memory_allocated(self.device) - weights + max(0, outside_torch)
        self.outside_torch_bytes = max(0, outside_torch)
        self.weight_bytes = weights
        kv_bytes = kv_cache_bytes(total, self.cfg.gpu_memory_utilization, weights, self.activation_bytes,
                                  self.graph_bytes_reserved())
        blocks = self.kv_spec.num_blocks_for(kv_bytes, self.draft.kv_spec if self.draft is not None else None)
        if blocks < 1:
            raise ValueError("no GPU memory is left for the KV cache after the weights and activations; "
                             "raise --gpu-memory-utilization or lower --max-num-batched-tokens")
        return blocks

    def graph_bytes_reserved(self) -> int:
        """GPU memory set aside for the decode and piecewise graphs captured after the pool is sized."""
        if self.cfg.enforce_eager:
            return 0
        tp = self.comm.size  # this rank's share of the activations
        graphs = estimate_graph_bytes(self.model_cfg, self.dtype_name, self.cfg.max_num_seqs, self.max_model_len,
                                      self.cfg.block_size, tp)
        prefill_tokens: list[int] = []  # the token count of each graphed forward with prompt tokens
        if self.cfg.piecewise_graphs:
            graphs += estimate_piecewise_graph_bytes(self.model_cfg, self.dtype_name, self.piecewise_max_tokens, tp)
            step_tokens = self.step_max_tokens
            if step_tokens > 0:
                graphs += estimate_step_graph_bytes(self.cfg.max_num_seqs, self.max_model_len, self.cfg.block_size,
                                                    step_tokens)
            prefill_tokens = graphed_token_counts(self.cfg.max_num_seqs, self.piecewise_max_tokens, step_tokens,
                                                  self._slow_buckets())
        if self.draft is not None:
            graphs += estimate_graph_bytes(self.draft.model.cfg, self.dtype_name, self.cfg.max_num_seqs,
                                           self.max_model_len, self.cfg.block_size, 1)
        if tp > 1 and self.device.type == "cuda":  # NCCL's memory for the collectives the graphs capture
            stage = self.model.stage
            graphs += NCCL_BYTES_PER_CAPTURE * nccl_captures(
                graph_buckets(self.cfg.max_num_seqs), prefill_tokens, self.model_cfg.hidden_size * self.dtype.itemsize,
                stage.num_layers, stage.first, stage.last, *self.comm.peer_limits())
        return graphs

    @torch.inference_mode()
    def profile_run(self, sample: bool = True) -> None:
        """One forward over max_num_batched_tokens tokens, writing nowhere, then the sampler at its
        most expensive (top-k, top-p, logprobs on max_num_seqs rows), to measure the activation peak;
        also the sampling kernel once (sample=False: that alone)."""
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        spec = self.kv_spec
        pool = KVPool(spec, 1, self.device, self.dtype)
        meta = AttnMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([min(n, spec.block_size)], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            num_decode=0, max_query_len=n)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.zeros(n, dtype=torch.int64, device=self.device)
        rows = min(n, self.cfg.max_num_seqs)
        logits = self.model(self.ops, ids, pos, pool.layers, meta, torch.arange(rows, device=self.device),
                            self._blank_carry(n))
        del pool
        if self.model.stage.last:
            # rows without logprobs take the sampling kernel: compiled here (on a thread in the
            # early dry pass), not at the first sampled request
            nucleus = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9)
            sample_on_device(logits, SamplingBatch([nucleus] * rows, [0] * rows), self.generator)
            # and its float32 form, which rows with adjusted logits take (engine/logit_adjust.py), and
            # the penalties' kernel
            adjusted = logits.float()
            sample_on_device(adjusted, SamplingBatch([nucleus] * rows, [0] * rows), self.generator)
            from kernels.penalties import penalize_rows

            one = torch.zeros(1, dtype=torch.int64, device=self.device)
            penalize_rows(adjusted, one, one, torch.ones((1, 3), device=self.device),
                          torch.zeros((1, adjusted.shape[1]), device=self.device),
                          torch.zeros((1, adjusted.shape[1]), dtype=torch.bool, device=self.device))
            from kernels.logprob_stats import logprob_stats  # prompt logprobs' (engine/prompt_logprobs.py)

            logprob_stats(logits, torch.zeros(rows, dtype=torch.int64, device=self.device))
        worst = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, logprobs=20)
        if sample and self.model.stage.last:
            sample_on_device(logits, SamplingBatch([worst] * rows, [0] * rows), self.generator).to_host()
        torch.cuda.synchronize(self.device)

    def step_costs(self, early: Callable[[], None] | None = None) -> StepCostModel:
        """The cost model from the disk cache (engine/cost_cache.py) where this GPU, code and
        configuration were measured before, else measured now and stored. Rank 0 decides for all.
        early: run before measuring only. A start that finds the model finds the kernels it compiled
        in Triton's cache too (whose directory is in the key): an early compile pass would only
        repeat ~100 forwards in Python (~6 s of an 8B warm start on an H100)."""
        from engine import cost_cache

        key = cost_cache.cost_key(self._cost_conditions())
        stored = self.comm.broadcast_object(cost_cache.load(key) if self.comm.rank == 0 else None)
        if stored is not None:
            try:
                model = StepCostModel(tuple(stored["rows"]), tuple(stored["forward_ms"]),
                                      float(stored["kv_ms_per_token"]), self.cfg.max_num_batched_tokens,
                                      self.cfg.max_step_ms, pipelined=self.pipe is not None)
            except (KeyError, TypeError, ValueError):
                model = None  # a damaged file: measure (every rank got the same file, so all do)
            if model is not None:
                self._log_step_costs(model, self.kv_spec.bytes_per_token / model.kv_ms_per_token * 1e3,
                                     f" (measured before: {cost_cache.cache_dir() / key})")
                return model
        if early is not None:
            early()
        model = self.comm.broadcast_object(self.measure_step_costs())
        if self.comm.rank == 0:
            cost_cache.store(key, {"rows": list(model.rows), "forward_ms": list(model.forward_ms),
                                   "kv_ms_per_token": model.kv_ms_per_token})
        return model

    def _cost_conditions(self) -> dict:
        """What the cost model's forwards depend on: the GPU and its software, the model, this
        rank's share of it, the engine's configuration (engine/cost_cache.py adds the sources)."""
        import dataclasses

        import triton

        try:
            from triton import knobs
            triton_cache = knobs.cache.dir
        except (ImportError, AttributeError):  # pragma: no cover (triton < 3.4)
            triton_cache = os.environ.get("TRITON_CACHE_DIR", "")
        props = torch.cuda.get_device_properties(self.device)
        stage = self.model.stage
        return {"gpu": props.name, "gpu_memory": props.total_memory, "sms": props.multi_processor_count,
                "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__, "triton_cache": triton_cache,
                "model": dataclasses.asdict(self.model_cfg), "dtype": self.dtype_name,
                "kv": dataclasses.asdict(self.kv_spec), "engine": dataclasses.asdict(self.cfg),
                "tp": [self.comm.rank, self.comm.size], "stage": [stage.start, stage.end],
                "max_model_len": self.max_model_len, "sizes": self._cost_sizes()}

    @torch.inference_mode()
    def measure_step_costs(self, timer: Callable[..., float] | None = None, heater: _Heater | None = None) -> StepCostModel:
        """The device time of forwards of a few sizes (prompt chunks of CHUNK tokens, writing no KV)
        and the copy bandwidth, for the scheduler's prompt budget (engine/cost_model.py). timer: (fn,
        head=None) -> ms (default: the device timer, _device_ms); head, where given, fills the head
        start with the heater's matmuls, which hold the GPU at its power limit (HOT_ABOVE; the
        default heater on a GPU, none on the CPU)."""
        # five repeats: one slow outlier must not make a bucket look beaten (engine/cost_model.py)
        timer = timer or (lambda fn, head=None: _device_ms(fn, repeats=5, comm=self.comm, head=head))
        sizes = self._cost_sizes()
        pool = KVPool(self.kv_spec, 1, self.device, self.dtype)
        can_heat = heater is not None or self.device.type == "cuda"
        forward_ms: list[float] = []
        hot = False  # sizes ascend: from the first compute-bound one on, each is timed at the power limit
        for n in sizes:
            fn = self._forward_fn(n, pool)
            ms = timer(fn, heater.run) if hot else timer(fn)
            # every rank switches at the same size (their forwards' collectives pair up by count); the
            # heater is built there, so a model with no compute-bound size never holds its buffers
            if (not hot and can_heat and forward_ms
                    and self.comm.max_int(int(ms > HOT_ABOVE * forward_ms[0]))):
                hot = True
                if heater is None:
                    heater = _Heater(self.device, self.comm)
                heater.run(HEAT_MS)
                ms = timer(fn, heater.run)
            forward_ms.append(ms)
        del pool, heater
        nbytes = 256 << 20
        buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        copy_ms = timer(lambda: buffers[1].copy_(buffers[0]))
        buffers.clear()
        bandwidth = 2 * nbytes / (copy_ms / 1e3)  # bytes read + written per second
        model = StepCostModel(tuple(sizes), tuple(forward_ms), self.kv_spec.bytes_per_token / bandwidth * 1e3,
                              self.cfg.max_num_batched_tokens, self.cfg.max_step_ms, pipelined=self.pipe is not None)
        self._log_step_costs(model, bandwidth)
        return model

    def _log_step_costs(self, model: StepCostModel, bandwidth: float, source: str = "") -> None:
        d = min(64, self.cfg.max_num_seqs)
        slow = sorted(model.dominated)
        log.info("step cost model%s: a forward of %s rows %s ms%s, copy %.2f TB/s; %d decodes take up to %d prompt "
                 "tokens beside them", source, "/".join(map(str, model.rows)),
                 "/".join(f"{t:.2f}" for t in model.forward_ms),
                 f" ({'/'.join(map(str, slow))} rows pad to a faster size)" if slow else "",
                 bandwidth / 1e12, d, model.prompt_budget(d, d * 512))

    def _cost_sizes(self) -> list[int]:
        """The forward sizes the cost model times: the token counts the graphs capture, what a step pays."""
        top = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        top = min(top, COST_MAX_ROWS)  # a mixed step stays below it; beyond, the model extrapolates
        sizes = step_buckets(top)
        return sizes if len(sizes) >= 2 else [1, max(2, top)]

    def _forward_fn(self, n: int, pool: KVPool) -> Callable[[], object]:
        """The model over n prompt tokens in chunks of COST_CHUNK, slots -1 (writes nowhere)."""
        lens = [min(COST_CHUNK, n - i) for i in range(0, n, COST_CHUNK)]
        starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        i32 = torch.tensor(lens + starts, dtype=torch.int32, device=self.device)
        meta = AttnMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((len(lens), self.max_blocks_per_seq), dtype=torch.int32, device=self.device),
            seq_lens=i32[:len(lens)], query_start_loc=i32[len(lens):], num_decode=0, max_query_len=max(lens))
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(k) for k in lens]).to(self.device)
        last = i32[len(lens) + 1:].long() - 1
        carry = self._blank_carry(n)
        return lambda: self.model(self.ops, ids, pos, pool.layers, meta, last, carry)

    def _blank_carry(self, n: int) -> torch.Tensor | None:
        """A pipeline stage's stand-in input for n tokens in start-up forwards (None on the first stage)."""
        if self.model.embed_tokens is not None:
            return None
        return torch.zeros((2, n, self.model_cfg.hidden_size), dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def warmup(self, sample: bool = True, layers: list | None = None, eager_decodes: bool | None = None) -> None:
        """Compile, before the first request, the kernel variants that eager steps use, in steps that
        write nowhere: mixed steps (decodes + one prefill chunk) with one decode per prefill tile
        height and two longer chunks, and with each power-of-two decode count (decode attention's
        variant follows the count rounded up to one) and the smallest chunk; with --enforce-eager
        also a decode-only step per count (those fuse rotary into attention: other variants). The
        decode graphs' own variants come with their capture. For compile_ahead's dry passes: sample=False runs the forwards only,
        layers replaces the KV pool's, eager_decodes overrides "no decode graphs"."""
        layers = self.pool.layers if layers is None else layers
        eager_decodes = self.graphs is None if eager_decodes is None else eager_decodes
        top = self.cfg.max_num_seqs
        counts = [min(1 << i, top) for i in range((top - 1).bit_length() + 1)]
        # a chunk over 64 tokens takes another prefill kernel (kernels/prefill_attention.py's
        # prefill_plan: prefill_ws.py's on an H100), for heads of 64 dims only past the whole-step
        # graphs' sizes; the step graphs capture it only in their work-list form
        from kernels.prefill_attention import WS_NARROW_MIN_QUERY_LEN as long_chunk

        for nd in counts:
            for chunk in (16, 32, 64, 128, long_chunk) if nd == 1 else (16,):
                if chunk < self.max_model_len and (chunk < long_chunk or chunk < self.cfg.max_num_batched_tokens):
                    self._warmup_step(nd, chunk, layers, sample)
            if eager_decodes:
                self._warmup_step(nd, 0, layers, sample)

    def _warmup_step(self, nd: int, chunk: int, layers: list, sample: bool = True) -> None:
        """nd decodes of length 1 and a prefill chunk of `chunk` tokens (0: none), slots -1."""
        nseq, n = nd + (1 if chunk else 0), nd + chunk
        seq_lens = [1] * nd + ([chunk] if chunk else [])
        starts = list(range(nd + 1)) + ([n] if chunk else [])
        i32 = torch.tensor(seq_lens + starts, dtype=torch.int32, device=self.device)
        meta = AttnMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((nseq, self.max_blocks_per_seq), dtype=torch.int32, device=self.device),
            seq_lens=i32[:nseq], query_start_loc=i32[nseq:], num_decode=nd, max_query_len=max(chunk, 1))
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.zeros(nd, dtype=torch.int64), torch.arange(chunk)]).to(self.device)
        last = torch.tensor([0] * nd + ([chunk - 1] if chunk else []), device=self.device)
        logits = self.model(self.ops, ids, pos, layers, meta, torch.arange(nseq, device=self.device) + last,
                            self._blank_carry(n))
        if not sample or not self.model.stage.last:
            return
        sample_on_device(logits, SamplingBatch([SamplingParams(max_tokens=1, temperature=0)] * nseq, [0] * nseq),
                         self.generator).to_host()

    def prepare(self, batch: Batch, prev: Launched | None = None, drafts: Proposed | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, torch.Tensor, SamplingBatch, list[int]]:
        """Host-side inputs of one step, built with numpy and sent to the device in one copy:
        int64 [ids | positions | slots | logit indices | pending] then int32 [seq_lens | query
        starts | a mixed step's prefill query starts | tables]. A decode whose input token is
        pending (sampled by `prev`, still on the device) gets it there: pending = [step positions |
        rows of prev's samples]."""
        items = batch.items
        n_seqs = len(items)
        self._reserve_rows(n_seqs)
        host = self._decode_inputs(items, prev) if batch.is_decode_only else self._mixed_inputs(batch, prev, drafts)
        n_tok, head, width = host.num_tokens, host.head, host.width
        both = self._upload(host.i64.view(np.uint8), host.i32.view(np.uint8))
        d64, d32 = both[:host.i64.nbytes].view(torch.int64), both[host.i64.nbytes:].view(torch.int32)
        full = self.block_tables[:n_seqs]
        full[:, :width].copy_(d32[head:].view(n_seqs, width))
        has_pq = head > 2 * n_seqs + 1
        meta = AttnMetadata(
            slot_mapping=d64[2 * n_tok:3 * n_tok],
            block_tables=full,
            seq_lens=d32[:n_seqs],
            query_start_loc=d32[n_seqs:2 * n_seqs + 1],
            num_decode=batch.num_decode,
            max_query_len=host.max_query_len,
            prefill_query_start_loc=d32[2 * n_seqs + 1:head] if has_pq else None,
        )
        sampled = host.sampled
        sbatch = _sampling_batch(items, sampled)
        input_ids = d64[:n_tok]
        n_logits = host.num_logits
        if host.num_pending:
            k, at = host.num_pending, 3 * n_tok + n_logits
            if drafts is not None:
                source = drafts.source
            else:
                assert prev is not None and prev.samples is not None
                source = prev.samples.tokens
            take_pending(input_ids, d64[at:at + 2 * k], k, source)
        return input_ids, d64[n_tok:2 * n_tok], meta, d64[3 * n_tok:3 * n_tok + n_logits], sbatch, sampled

    def _upload(self, a: np.ndarray, b: np.ndarray) -> torch.Tensor:
        """a then b (bytes) on the device, in one transfer (each costs the host more than its bytes)
        from a pinned buffer of the ring."""
        n = a.nbytes + b.nbytes
        if self.uploads is None or n > self.uploads.nbytes:
            both = torch.from_numpy(np.concatenate([a, b]))
            return both.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else both
        buf = self.uploads.buffer()
        buf[:a.nbytes] = a
        buf[a.nbytes:n] = b
        both = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.uploads.send(both, n)
        return both

    def _decode_inputs(self, items: list[ScheduledSeq], prev: Launched | None) -> HostInputs:
        """prepare() for a decode-only step, the common one: one token per item, at position
        start, so plain lists and one conversion do (no cumulative sums, no repeats)."""
        bs = self.kv_spec.block_size
        n = len(items)
        ids, starts, pend, rows, width = self._decode_rows(items, prev)
        pend_at = [i for i, p in enumerate(pend) if p >= 0]
        pending_rows = [pend[i] for i in pend_at]
        sampled = [i for i, it in enumerate(items) if it.samples]
        i64 = np.array(ids + starts + starts + sampled + pend_at + pending_rows, dtype=np.int64)
        pos = i64[n:2 * n]
        i64[2 * n:3 * n] = self._row_store[rows, pos // bs].astype(np.int64) * bs + pos % bs  # slots
        head = 2 * n + 1
        i32 = np.empty(head + n * width, dtype=np.int32)
        np.add(i64[n:2 * n], 1, out=i32[:n], casting="unsafe")  # seq_lens: start + 1
        i32[n:head] = np.arange(n + 1)
        i32[head:].reshape(n, width)[:] = self._row_store[rows, :width]
        return HostInputs(i64, i32, n, head, width, 1, sampled, len(pend_at))

    def _decode_rows(self, items: list[ScheduledSeq], prev: Launched | None
                     ) -> tuple[list[int], list[int], list[int], list[int], int]:
        """A decode step's rows: (input ids, 0 where pending; positions; pending rows of prev's
        samples, -1 where the id is known; rows of _row_store holding the block tables; the widest
        table). _reserve_rows() must have made room first."""
        ids: list[int] = []
        starts: list[int] = []
        pend: list[int] = []
        rows: list[int] = []
        width = 0
        for it in items:
            seq = it.seq
            start, toks, table = it.start, seq.token_ids, seq.block_table
            if start < len(toks):
                ids.append(toks[start])
                pend.append(-1)
            else:
                # sampled by prev (by its last step, if it ran several)
                assert prev is not None and start >= len(toks), "a pending token without the step that samples it"
                ids.append(0)
                pend.append(prev.rows[seq.seq_id])
            starts.append(start)
            rows.append(self._table_row(seq.seq_id, table))
            if len(table) > width:
                width = len(table)
        return ids, starts, pend, rows, width

    def _mixed_inputs(self, batch: Batch, prev: Launched | None, drafts: Proposed | None = None) -> HostInputs:
        """prepare() for a step with prefill chunks (several tokens per item), after any decodes. drafts:
        a draft model's, whose tokens are pending inputs (read from drafts.source on the device)."""
        bs = self.kv_spec.block_size
        items = batch.items
        n_seqs, n_tok = len(items), batch.num_tokens
        q_lens = np.fromiter((it.num_new_tokens for it in items), dtype=np.int64, count=n_seqs)
        starts = np.fromiter((it.start for it in items), dtype=np.int64, count=n_seqs)
        qsl = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        width = max(len(it.seq.block_table) for it in items)  # the columns used; stale ones beyond are never read
        nd = batch.num_decode
        n_pq = n_seqs - nd + 1 if 0 < nd < n_seqs else 0  # a mixed step's prefill query starts
        head = 2 * n_seqs + 1 + n_pq
        i32 = np.zeros(head + n_seqs * width, dtype=np.int32)
        tables = i32[head:].reshape(n_seqs, width)
        pend_at: list[int] = []
        pend_rows: list[int] = []
        ids_list: list[int] = []
        rows: list[int] = []
        num_drafted = 0
        for i, it in enumerate(items):
            rows.append(self._table_row(it.seq.seq_id, it.seq.block_table))
            toks = it.seq.token_ids
            if it.draft is not None:  # the last token, then the draft
                if it.start < len(toks):
                    ids_list.append(toks[it.start])
                else:  # sampled by prev
                    assert prev is not None and it.start == len(toks), "a pending token without the step that samples it"
                    ids_list.append(0)
                    pend_at.append(int(qsl[i]))
                    pend_rows.append(prev.rows[it.seq.seq_id])
                if drafts is None:
                    ids_list += it.draft
                else:
                    first = int(qsl[i]) + 1
                    pend_at += range(first, first + len(it.draft))
                    pend_rows += drafts.rows(num_drafted)
                    ids_list += [0] * len(it.draft)
                    num_drafted += 1
                continue
            if it.end <= len(toks):
                ids_list += toks[it.start:it.end]
                continue
            # the chunk's last token is pending: sampled by prev (by its last step, if it ran several)
            assert prev is not None and (it.end == len(toks) + 1 or (it.num_new_tokens == 1 and it.start >= len(toks))), \
                "a pending token without the step that samples it"
            ids_list += toks[it.start:]
            ids_list.append(0)
            pend_at.append(int(qsl[i + 1]) - 1)
            pend_rows.append(prev.rows[it.seq.seq_id])
        tables[:] = self._row_store[rows, :width]
        ids = np.array(ids_list, dtype=np.int64)
        seq_idx = np.repeat(np.arange(n_seqs), q_lens)
        positions = np.arange(n_tok, dtype=np.int64) - np.repeat(qsl[:-1], q_lens) + np.repeat(starts, q_lens)
        slots = tables[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        sampled = [i for i, it in enumerate(items) if it.samples]
        if batch.has_drafts:  # every position of a draft's item samples
            logit_idx = np.concatenate([np.arange(qsl[i], qsl[i + 1]) if items[i].draft is not None
                                        else qsl[i + 1:i + 2] - 1 for i in sampled]).astype(np.int64)
        else:
            logit_idx = qsl[1:][sampled] - 1 if sampled else np.zeros(0, dtype=np.int64)
        i32[:n_seqs] = starts + q_lens
        i32[n_seqs:2 * n_seqs + 1] = qsl
        if n_pq:
            i32[2 * n_seqs + 1:head] = qsl[nd:] - nd
        i64 = np.concatenate([ids, positions, slots, logit_idx, np.array(pend_at + pend_rows, dtype=np.int64)])
        return HostInputs(i64, i32, n_tok, head, width, int(q_lens.max()), sampled, len(pend_at))

    # Rows of _table_row, [4 * max_num_seqs, max_blocks_per_seq] int32, made on first use: a step's
    # tables are gathered from it in one indexing operation.
    _row_store: np.ndarray | None = None

    def _reserve_rows(self, n: int) -> None:
        """Room in the row store for n more sequences, made before a step takes its rows: when it
        is full, the rows of finished sequences are dropped (the live ones refill)."""
        if self._row_store is None or len(self._row_store) < n:
            self._row_store = np.zeros((max(4 * self.cfg.max_num_seqs, n), self.max_blocks_per_seq), dtype=np.int32)
            self._rows.clear()
        elif len(self._rows) + n > len(self._row_store):
            self._rows.clear()

    def _table_row(self, seq_id: int, table: list[int]) -> int:
        """The index in _row_store of seq's block table as a fixed-width int32 row, kept between
        steps and extended in place: converting a long table from a Python list every step costs
        ~10 us per sequence at 4k tokens. A preempted sequence gets a new list object, which
        invalidates its row. _reserve_rows() must have made room first.
        self._rows: seq_id -> [block table list, its row's index, entries filled]."""
        hit = self._rows.get(seq_id)
        if hit is not None and hit[0] is table and hit[2] == len(table):
            return hit[1]  # most decode steps: no new block
        store = self._row_store
        if hit is None or hit[0] is not table or hit[2] > len(table):
            index = len(self._rows) if hit is None else hit[1]
            store[index] = 0
            hit = [table, index, 0]
            self._rows[seq_id] = hit
        _, index, filled = hit
        store[index, filled:len(table)] = table[filled:]
        hit[2] = len(table)
        return index

    def enable_step_timing(self) -> None:
        """CUDA events around every step (step traces only): gpu_times() then says how long the
        GPU spent on each step and how long it sat idle before it."""
        self._step_timing = self.device.type == "cuda"

    def gpu_times(self, launched: Launched) -> tuple[float, float] | None:
        """(ms from the step's first queued work to its last on the GPU, ms the GPU was idle between
        the previous timed step's end and this step's start, which counts time with nothing to
        run), once collect() has returned."""
        if launched.events is None:
            return None
        start, end = launched.events
        end.synchronize()
        idle = self._last_end.elapsed_time(start) if self._last_end is not None else 0.0
        self._last_end = end
        return start.elapsed_time(end), idle

    def launch(self, batch: Batch, prev: Launched | None = None) -> Launched:
        if not self._step_timing:
            return self._launch(batch, prev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launched = self._launch(batch, prev)
        end.record()
        launched.events = (start, end)
        return launched

    @torch.inference_mode()
    def _launch(self, batch: Batch, prev: Launched | None = None) -> Launched:
        """Queue one step on the device (inputs, forward, sampling, the copy of the token ids back)
        without waiting for it. A pending input token is read from prev's samples on the device."""
        if prev is not None and prev.deferred is not None:
            self.finish(prev)  # this step may read prev's tokens on the device
        if self.offload is not None:  # the host tier's copies, before this step's forward (kvcache/host_pool.py)
            self.offload.before_step(batch.kv_moves)
        self._lora_inputs(batch.items)
        if self.pipe is not None:
            return self._launch_stage(batch)
        n = len(batch.items)
        g = self.graphs
        if g is not None and batch.is_decode_only and n <= g.max_bs and all(it.samples for it in batch.items):
            return self._launch_graph(batch, prev)
        assert batch.num_steps == 1, "a multi-step batch needs the decode graphs (build_engine turns it off without them)"
        drafts = self._proposed(batch, prev) if self.model_drafts and batch.has_drafts else None
        launched = None
        if self.steps is not None and not batch.is_decode_only:
            key = self.steps.key(batch.num_decode, n - batch.num_decode, batch.num_tokens)
            # a draft's positions each take a logit row, and a draft model's tokens are pending inputs
            # too; the graph's inputs hold 3 words a sequence for a logit row and a pending token's two
            drafted = sum(len(it.draft) for it in batch.items[batch.num_decode:] if it.draft is not None)
            if key is not None and 3 * n + drafted * (1 if drafts is None else 3) <= 3 * self.steps.num_seqs:
                launched = self._launch_step_graph(batch, prev, key, drafts)
        if launched is None:
            input_ids, positions, meta, logit_idx, sbatch, sampled = self.prepare(batch, prev, drafts)
            hidden = self._forward(input_ids, positions, meta)
            launched = self._sample_hidden(batch, hidden, logit_idx, sbatch, sampled, prompt_rows(batch.items))
        launched.proposed = drafts
        return launched

    def _proposed(self, batch: Batch, prev: Launched | None) -> Proposed:
        """A draft model's tokens for a step's drafted items: proposed here, or (a tensor-parallel rank
        other than 0) rank 0's."""
        drafted = [it for it in batch.items[batch.num_decode:] if it.draft is not None]
        prev_tokens = prev.samples.tokens if prev is not None and prev.samples is not None else None
        if self.draft is not None:
            tokens = self._propose(drafted, prev, prev_tokens)
        else:
            tokens = torch.empty((self.model_drafts, len(drafted)), dtype=torch.int64, device=self.device)
        self.comm.broadcast(tokens)
        flat = tokens.reshape(-1)
        return Proposed(tokens, flat if prev_tokens is None else torch.cat([prev_tokens, flat]),
                        0 if prev_tokens is None else prev_tokens.shape[0],
                        [(it.seq, it.start, it.seq.block_table) for it in drafted])

    def _propose(self, drafted: list[ScheduledSeq], prev: Launched | None,
                 prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """The draft model's round for a step's drafted items (engine/draft.py): the forwards that catch
        their draft KV up, then its k + 1 greedy steps from each one's last token (pending ones read
        from prev's samples, prev_tokens, on the device) -> the drafts [k, n]."""
        draft = self.draft
        assert draft is not None
        for chunk in catch_up_chunks(drafted, self.cfg.max_num_batched_tokens):
            ids, pos, meta, *_ = self.prepare(Batch(chunk, 0, 1))
            draft.forward(ids, pos, meta)
        n = len(drafted)
        g = draft.graphs
        if g is not None and n <= g.max_bs:
            words = self._graph_inputs(drafted, prev, g.host_inputs())
            if prev_tokens is not None:  # where the graphs read pending input tokens
                g.tokens[:prev_tokens.shape[0]].copy_(prev_tokens)
            tokens = g.replay_steps(n, words, draft.k + 1)[:draft.k].clone()
        else:
            ids, pos, meta, *_ = self.prepare(Batch([ScheduledSeq(it.seq, it.start, 1) for it in drafted], n, 1), prev)
            tokens = draft.steps(ids, pos, meta.block_tables)[:draft.k].contiguous()
        return tokens

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                 carry: torch.Tensor | None = None) -> torch.Tensor:
        """An eager or piecewise forward -> the final hidden states of every row (_sample_hidden takes
        the logits it needs from them), or a pipeline stage's carry for the next stage."""
        if self.piecewise is not None and input_ids.shape[0] <= self.piecewise.max_tokens:
            return self.piecewise.run(input_ids, positions, meta, None, carry)
        return self.model(self.ops, input_ids, positions, self.pool.layers, meta, None, carry)

    def _launch_stage(self, batch: Batch) -> Launched:
        """launch() on a pipeline stage: the carry from the previous stage (the first embeds), this
        stage's layers, then the carry on to the next stage, or (the last) the logits and sampling.
        The batch's sequences have no pending tokens: the scheduler keeps a sequence out of the
        batches launched while one it is in is still in flight."""
        pipe = self.pipe
        assert pipe is not None and batch.num_steps == 1
        n = len(batch.items)
        g = self.graphs
        prompt = prompt_rows(batch.items)  # a one-token chunk of a prompt that asks for its logprobs: eager
        if g is not None and batch.is_decode_only and n <= g.max_bs and prompt is None:  # decodes: every row samples
            if pipe.next is None:
                return self._launch_graph(batch, None, self._recv_carry(n))
            words = self._graph_inputs(batch.items, None, g.host_inputs())
            if pipe.prev is not None:
                g.carry[:, :n].copy_(self._recv_carry(n))
            # a copy: the next replay overwrites the static output while the send may still read it
            return Launched(None, {}, [], n, sent=pipe.send_carry(g.replay_carry(n, words, self._lora_used).clone()))
        input_ids, positions, meta, logit_idx, sbatch, sampled = self.prepare(batch)
        out = self._forward(input_ids, positions, meta, self._recv_carry(input_ids.shape[0]))
        if pipe.next is not None:
            return Launched(None, {}, [], n, sent=pipe.send_carry(out))
        return self._sample_hidden(batch, out, logit_idx, sbatch, sampled, prompt)

    def _recv_carry(self, num_tokens: int) -> torch.Tensor | None:
        """The previous pipeline stage's carry for this step (None on the first stage)."""
        pipe = self.pipe
        if pipe is None or pipe.prev is None:
            return None
        return pipe.recv_carry(num_tokens, self.model_cfg.hidden_size, self.dtype, self.device)

    def _sample_hidden(self, batch: Batch, hidden: torch.Tensor, logit_idx: torch.Tensor, sbatch: SamplingBatch,
                       sampled: list[int], prompt: PromptRows | None) -> Launched:
        """_sample() of a forward's final hidden states: the sampling rows' logits are taken from them,
        the prompt's rows (if any) give prompt logprobs, and embedding requests' rows are pooled."""
        launched = self._sample(batch, self.model.compute_logits(hidden[logit_idx]), sbatch, sampled)
        if prompt is not None:
            launched.prompt = compute_prompt_logprobs(hidden, prompt, batch.items, self.model.compute_logits,
                                                      self.cfg.max_num_seqs)
        spans = pooled_spans(batch.items)
        if spans:
            launched.pooled = PooledSamples(hidden, spans)
        return launched

    def _sample(self, batch: Batch, logits: torch.Tensor, sbatch: SamplingBatch, sampled: list[int]) -> Launched:
        """Queue the sampling of a step's logits (a row per sampling item) and the tokens' copy back."""
        n = len(batch.items)
        if not sampled:
            return Launched(None, {}, [], n)
        items = batch.items
        if batch.has_drafts:
            # a draft's rows are consecutive; no step follows before these tokens are known
            starts = np.cumsum([0] + [_logit_rows(items[i]) for i in sampled])
            launched = Launched(None, {items[i].seq.seq_id: int(starts[j]) for j, i in enumerate(sampled)}, sampled, n,
                                drafts=[(int(starts[j]), items[i].draft) for j, i in enumerate(sampled)])
            self._draw(launched, logits, sbatch, _logit_items(items, sampled), None)
            return launched
        rows = {items[i].seq.seq_id: j for j, i in enumerate(sampled)}
        launched = Launched(None, rows, sampled, n)
        # where a decode graph that follows reads its pending input tokens
        tokens_out = self.graphs.tokens[:len(sampled)] if self.graphs is not None else None
        self._draw(launched, logits, sbatch, [items[i] for i in sampled], tokens_out)
        return launched

    def _draw(self, launched: Launched, logits: torch.Tensor, sbatch: SamplingBatch, items: list[ScheduledSeq],
              tokens_out: torch.Tensor | None) -> None:
        """Queue the sampling of logits (a row per item) into launched.samples, and the tokens' copy
        back. Constrained rows are masked first (engine/grammar_mask.py), outside any graph; where
        one's previous token is still pending on the device, the sampling waits for finish()."""
        if GrammarMasks.constrained(items):
            if self.grammar is None:
                raise RuntimeError("a request asks for constrained decoding, which this engine was not set up for")
            if not GrammarMasks.tokens_known(items):
                launched.deferred = DeferredSample(logits, sbatch, items, tokens_out)
                return
            masks = self.grammar.masks(items)
            if masks is not None:
                apply_token_bitmask(logits, *masks)
        samples = self._sample_adjusted(logits, items, sbatch)
        if tokens_out is not None:
            tokens_out.copy_(samples.tokens)
        samples.start_copy(self.host_slots)
        launched.samples = samples

    @torch.inference_mode()
    def finish(self, launched: Launched) -> None:
        """Queue a launched step's deferred sampling (constrained rows), once the tokens of the step
        before it are on the host: the engine core calls it right after processing that step, so the
        masks are filled while this step's forward runs. Idempotent."""
        deferred, launched.deferred = launched.deferred, None
        if deferred is not None:
            self._draw(launched, deferred.logits, deferred.sbatch, deferred.items, deferred.tokens_out)

    def _launch_step_graph(self, batch: Batch, prev: Launched | None, key: tuple[int, int],
                           drafts: Proposed | None = None) -> Launched:
        """launch() for a step with prefill tokens that a whole-step graph takes (engine/step_graph.py):
        the host inputs as for an eager step, uploaded in the graph's layout, then one replay."""
        items = batch.items
        self._reserve_rows(len(items))
        host = self._mixed_inputs(batch, prev, drafts)
        assert self.steps is not None
        pending = None
        if drafts is not None:
            pending = drafts.source
        elif host.num_pending:
            assert prev is not None and prev.samples is not None
            pending = prev.samples.tokens
        hidden, logit_rows = self.steps.run(key, host, batch.num_decode, len(items), pending)
        return self._sample_hidden(batch, hidden, logit_rows, _sampling_batch(items, host.sampled), host.sampled,
                                   prompt_rows(items))

    def _launch_graph(self, batch: Batch, prev: Launched | None, carry: torch.Tensor | None = None) -> Launched:
        """launch() for a decode step in which every row samples, replayed from a decode graph: its
        inputs go up in one copy and the graph samples greedy rows itself (engine/cuda_graph.py).
        carry: the last pipeline stage's input from the stage before."""
        items = batch.items
        n = len(items)
        g = self.graphs
        assert g is not None
        words = self._graph_inputs(items, prev, g.host_inputs())
        if carry is not None:
            g.carry[:, :n].copy_(carry)
        params = [it.seq.params for it in items]
        if batch.num_steps > 1:  # rows without logprobs or a grammar (the scheduler's rule)
            draw = None
            if any(p.temperature != 0.0 or p.adjusts_logits for p in params):
                sbatch = SamplingBatch(params, [it.end - it.seq.num_prompt_tokens for it in items])
                draw = lambda logits, step: self._sample_adjusted(logits, items, sbatch, step).tokens  # noqa: E731
            samples = DeviceSamples(g.tokens[:n], params, steps=g.replay_steps(n, words, batch.num_steps, draw,
                                                                               self._lora_used))
        elif all(p.temperature == 0.0 and p.logprobs is None and p.grammar is None and not p.adjusts_logits
                 for p in params):
            samples = DeviceSamples(g.replay(n, words, logits=False, adapters=self._lora_used)[1], params)
        else:  # sampled, with logprobs, constrained or adjusted: from the graph's logits
            logits, tokens = g.replay(n, words, adapters=self._lora_used)
            sbatch = SamplingBatch(params, [it.end - it.seq.num_prompt_tokens for it in items])
            launched = Launched(None, {it.seq.seq_id: i for i, it in enumerate(items)}, list(range(n)), n)
            self._draw(launched, logits, sbatch, items, tokens)
            return launched
        samples.start_copy(self.host_slots)
        return Launched(samples, {it.seq.seq_id: i for i, it in enumerate(items)}, list(range(n)), n)

    def _sample_adjusted(self, logits: torch.Tensor, items: list[ScheduledSeq], sbatch: SamplingBatch,
                         step: int = 0) -> DeviceSamples:
        """sample_on_device, after engine/logit_adjust.py's adjustments where a row asks for them (the
        penalized rows' counts then take the sampled tokens); logprobs from the logits as they came."""
        if not LogitAdjuster.needed(items):
            return sample_on_device(logits, sbatch, self.generator, step)
        adjusted, count = self.adjuster.apply(logits, items, step)
        samples = sample_on_device(adjusted, sbatch, self.generator, step, raw=logits)
        count(samples.tokens)
        return samples

    def _graph_inputs(self, items: list[ScheduledSeq], prev: Launched | None, buf: np.ndarray) -> int:
        """A decode step's inputs in kernels/graph_inputs.py's layout, into buf (int64 words) ->
        the words used. A pending input token is read on the device from its row of prev's samples."""
        n = len(items)
        self._reserve_rows(n)
        ids, starts, pend, rows, width = self._decode_rows(items, prev)
        head = head_words(n)
        buf[0], buf[1] = n, width
        buf[2:head] = ids + starts + pend
        tables = buf.view(np.int32)[2 * head:2 * head + n * width].reshape(n, width)
        np.take(self._row_store[:, :width], rows, axis=0, out=tables, mode="clip")
        return head + -(-n * width // 2)

    def collect(self, launched: Launched) -> list[SampleOutput | None]:
        """Wait for a launched step's tokens: one SampleOutput per batch item that samples."""
        outputs: list[SampleOutput | None] = [None] * launched.num_items
        self.finish(launched)
        if launched.sent is not None:
            launched.sent.wait()
        if launched.samples is not None:
            tokens, logprobs = launched.samples.to_host()
            if launched.samples.steps is not None:  # [steps][n]: each row's first token and the later ones
                later = list(zip(*tokens[1:]))
                for j, i in enumerate(launched.sampled):
                    outputs[i] = SampleOutput(tokens[0][j], None, list(later[j]))
                return outputs
            if launched.drafts is not None:
                proposed = launched.proposed
                # a draft model's tokens, per drafted item (every drafted item of the step, in order)
                filled = proposed.tokens.T.tolist() if proposed is not None else None
                d = 0
                for i, (row, draft) in zip(launched.sampled, launched.drafts):
                    if draft is None:
                        outputs[i] = SampleOutput(tokens[row], logprobs[row])
                        continue
                    if filled is not None:
                        draft = filled[d]
                    kept = accepted(tokens[row:row + len(draft) + 1], draft)
                    if proposed is not None:  # its draft KV now covers the positions before the next last token
                        seq, start, table = proposed.items[d]
                        seq.draft_kv = (table, start + len(kept))
                        d += 1
                    outputs[i] = SampleOutput(kept[0], None, kept[1:])
            else:
                for j, i in enumerate(launched.sampled):
                    outputs[i] = SampleOutput(tokens[j], logprobs[j])
        if launched.prompt is not None:
            _attach(outputs, launched.prompt.to_host(), "prompt")
        if launched.pooled is not None:
            _attach(outputs, launched.pooled.to_host(), "pooled")
        return outputs

    def execute(self, batch: Batch) -> list[SampleOutput | None]:
        return self.collect(self.launch(batch))

    def release_graphs(self) -> None:
        """Free the CUDA graphs (the runner launches no more steps). Under tensor parallelism they
        hold the captured NCCL collectives, and destroy_process_group() hangs while any such graph
        lives (pytorch/pytorch#115388): each is reset here, whoever else still refers to it."""
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)  # no replay still running
        draft_graphs = self.draft.graphs if self.draft is not None else None
        for holder in (self.graphs, self.piecewise, self.steps, draft_graphs):
            if holder is None:
                continue
            # a decode graph's twin without the LoRA adapters (DecodeGraphs.plain) holds collectives too
            plain = [graph for graph, _ in getattr(holder, "plain", {}).values()]
            for g in list(holder.graphs.values()) + plain:
                for graph in (g if isinstance(g, list) else [g]):
                    graph.reset()
        self.graphs = self.piecewise = self.steps = None
        if self.draft is not None:
            self.draft.graphs = None
