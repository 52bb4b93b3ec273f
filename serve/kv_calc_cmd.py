"""`serve kv-calc`: how many KV-cache blocks, tokens and sequences fit on a GPU (the arithmetic in
kvcache/calc.py), and the two modes that run the engine: --measure (the engine's own sizing on the
local GPU next to the prediction) and --accuracy (serve/kv_accuracy.py)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.config import AUTO_SCHEDULER_STEPS, EngineConfig, ModelConfig, ModelConfigError
from engine.cost_model import MAX_ROWS as COST_MAX_ROWS, StepCostModel
from engine.parallel.graph_memory import NCCL_BYTES_PER_CAPTURE, nccl_captures
from engine.presets import resolve_model
from engine.quant import AT_LOAD
from kvcache.calc import (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_STEP_GRAPH_MAX_TOKENS,
                          DTYPE_BYTES, DoesNotFitError, KVCalcInputError, KVPlan, estimate_graph_bytes,
                          estimate_piecewise_graph_bytes, estimate_step_graph_bytes, plan, resolve_kv_cache_dtype,
                          LORA_TARGETS, LoraShape, resolve_model_dtype, table_kv_dtypes, weight_bytes_per_gpu)
from kvcache.gpus import GPUMemory, PresetError, find_gpu_preset, resolve_gpu_memory
from kvcache.host_tier import host_tier_blocks
from kvcache.spec import default_block_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Values are read as strings and checked in run(), so every mistake gets one line and exit 2.
    parser.add_argument("--model", help="model folder, config.json, or preset: Llama-3-8B, Llama-3-70B, "
                        "Qwen2.5-0.5B, Qwen2.5-7B, Mistral-7B, Qwen3-8B")
    parser.add_argument("--gpu-memory", help="memory of one GPU: a size (80GiB, 80GB) or a GPU name "
                        "(H100, H200, A100-40GB, A100-80GB, L4, RTX4090, ...)")
    parser.add_argument("--memory-utilization", "--gpu-memory-utilization", dest="memory_utilization",
                        default="0.9", help="fraction of GPU memory the engine may use (default 0.9)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | float16 | fp8 | int8")
    parser.add_argument("--dtype", default="auto", help="weights: auto | bfloat16 | float16 | float32")
    parser.add_argument("--block-size", default=None, help="tokens per KV block (default: 16; 32 for fp8/int8)")
    parser.add_argument("--max-model-len", default=None,
                        help="longest sequence, e.g. 8192 or 32k (default: the model's context, "
                             "max_position_embeddings stretched by linear or YaRN rope scaling)")
    parser.add_argument("--tensor-parallel-size", "-tp", default="1", help="GPUs the model is split over")
    parser.add_argument("--pipeline-parallel-size", "-pp", default="1",
                        help="stages the layers are split into (TP x PP GPUs); the figures are the GPU's that holds "
                        "the fewest KV blocks")
    parser.add_argument("--max-num-batched-tokens", default=str(DEFAULT_MAX_NUM_BATCHED_TOKENS),
                        help="most tokens in one step: sizes the activation estimate (default %(default)s)")
    parser.add_argument("--max-num-seqs", default=str(DEFAULT_MAX_NUM_SEQS),
                        help="most sequences in one step: sizes the logits in the estimate (default %(default)s)")
    parser.add_argument("--kv-offload-gib", default=None, metavar="GIB",
                        help="also show what a host tier of GIB GiB (serve run --kv-offload-gib) holds")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="fp8: the projections quantized as they load (serve run --quantization fp8); an FP8 "
                             "checkpoint is counted in FP8 without it")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=FOLDER",
                        help="LoRA adapters served beside the model (serve run --lora-modules): their stacked "
                             "weights are counted with the model's")
    parser.add_argument("--enable-lora", action="store_true",
                        help="count LoRA slots on every projection, as serve run --enable-lora makes them")
    parser.add_argument("--max-loras", default="0", help="with --enable-lora: adapters held at once (default 1)")
    parser.add_argument("--max-lora-rank", default="0", help="with --enable-lora: their largest rank (default 16)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='as serve run takes it: a draft model\'s, \'{"model": FOLDER, "num_speculative_tokens": '
                             '4}\', counts its weights and its KV pool (as many blocks as the model\'s) on the first GPU')
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--accuracy", action="store_true",
                        help="measure each KV dtype's accuracy against the bf16 cache (runs the model on the CPU; "
                        "--model: a folder with weights, default SmolLM2-135M-Instruct)")
    parser.add_argument("--text", metavar="FILE", default=None,
                        help="with --accuracy: the UTF-8 text to run (default: the shipped public-domain text)")
    parser.add_argument("--measure", action="store_true",
                        help="load the model on the local GPU and print the engine's measured sizing next to this one")


@dataclass(frozen=True)
class CalcRequest:
    """The CLI's arguments, checked."""
    model_name: str
    model: ModelConfig
    gpu_label: str
    gpu_memory_bytes: int
    memory_utilization: float
    kv_cache_dtype: str
    dtype: str
    block_size: int | None  # None: each KV dtype's default (kvcache/spec.py)
    max_model_len: int | None
    tensor_parallel_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    pipeline_parallel_size: int = 1
    gpu_rates: tuple[float, float] | None = None  # copy bandwidth and matmul rate, where the GPU is known
    lora: LoraShape | None = None  # --lora-modules
    draft: ModelConfig | None = None  # --speculative-config's draft model
    draft_name: str = ""


def _parse_int(flag: str, value: Any, least: int = 1) -> int:
    text = str(value).strip().lower()
    scale = 1024 if text.endswith("k") else 1
    try:
        number = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise KVCalcInputError(f"{flag} must be a whole number; got {value!r}") from None
    if number < least:
        raise KVCalcInputError(f"{flag} must be >= {least}; got {value!r}")
    return number


def _parse_fraction(flag: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise KVCalcInputError(f"{flag} must be a number in (0, 1], e.g. 0.9; got {value!r}") from None
    if not 0.0 < number <= 1.0:
        raise KVCalcInputError(f"{flag} must be in (0, 1], e.g. 0.9; got {value!r}")
    return number


def _check_engine_limits(req: CalcRequest) -> None:
    """What `serve run` would refuse, the calculator refuses too, with the same words."""
    dtype = resolve_model_dtype(req.dtype, req.model)
    kv_dtype = resolve_kv_cache_dtype(req.kv_cache_dtype, dtype)
    try:
        EngineConfig(dtype=dtype, kv_cache_dtype=kv_dtype, block_size=req.block_size,
                     max_model_len=req.max_model_len, gpu_memory_utilization=req.memory_utilization,
                     max_num_batched_tokens=req.max_num_batched_tokens, max_num_seqs=req.max_num_seqs)
    except ValueError as e:
        raise KVCalcInputError(str(e)) from None


def local_gpu() -> GPUMemory | None:
    """This machine's first CUDA GPU, if it has one (torch is imported only to ask)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    preset = find_gpu_preset(name)
    return GPUMemory(name, torch.cuda.mem_get_info()[1], preset.rates if preset is not None else None)


def read_request(args: argparse.Namespace) -> CalcRequest:
    if not args.model:
        raise KVCalcInputError("--model is required: a model folder, a config.json, or a preset such as Llama-3-8B")
    gpu = resolve_gpu_memory(str(args.gpu_memory)) if args.gpu_memory else local_gpu()
    if gpu is None:
        raise KVCalcInputError("--gpu-memory is required on a machine without a GPU: a size such as 80GiB or a GPU "
                               "such as H100")
    model = resolve_model(args.model)
    config = model.config
    if getattr(args, "quantization", None) == "fp8":
        try:
            config.check_quantization("fp8")
        except ModelConfigError as e:
            raise KVCalcInputError(str(e)) from None
        config = replace(config, quant=AT_LOAD)
    max_len = None if args.max_model_len in (None, "") else _parse_int("--max-model-len", args.max_model_len)
    req = CalcRequest(
        model_name=model.name, model=config, gpu_label=gpu.label, gpu_memory_bytes=gpu.total_bytes,
        memory_utilization=_parse_fraction("--memory-utilization", args.memory_utilization),
        kv_cache_dtype=str(args.kv_cache_dtype).lower(), dtype=str(args.dtype).lower(),
        block_size=None if args.block_size in (None, "") else _parse_int("--block-size", args.block_size),
        max_model_len=max_len,
        tensor_parallel_size=_parse_int("--tensor-parallel-size", args.tensor_parallel_size),
        pipeline_parallel_size=_parse_int("--pipeline-parallel-size", getattr(args, "pipeline_parallel_size", 1)),
        max_num_batched_tokens=_parse_int("--max-num-batched-tokens", args.max_num_batched_tokens),
        max_num_seqs=_parse_int("--max-num-seqs", args.max_num_seqs),
        gpu_rates=gpu.rates,
        lora=_lora(getattr(args, "lora_modules", None) or [], getattr(args, "enable_lora", False),
                   _parse_int("--max-loras", getattr(args, "max_loras", "0"), 0),
                   _parse_int("--max-lora-rank", getattr(args, "max_lora_rank", "0"), 0)),
    )
    draft = _draft_model(getattr(args, "speculative_config", None))
    if draft is not None:
        draft_config = draft.config
        try:
            config.check_draft(draft_config, draft.name)
            if getattr(args, "quantization", None) == "fp8":  # the engine quantizes the draft's weights too
                draft_config.check_quantization("fp8")
                draft_config = replace(draft_config, quant=AT_LOAD)
        except ModelConfigError as e:
            raise KVCalcInputError(str(e)) from None
        req = replace(req, draft=draft_config, draft_name=draft.name)
    _check_engine_limits(req)
    return req


def _draft_model(text: str | None) -> Any:
    """--speculative-config's draft model (engine/presets.py resolve_model's answer), or None."""
    if not text:
        return None
    from scheduler.request import SpeculativeConfig

    try:
        spec = SpeculativeConfig.from_dict(json.loads(text))
    except ValueError as e:  # JSON's and the config's own errors
        raise KVCalcInputError(f"--speculative-config: {e}") from None
    if spec.model is None:
        return None  # n-gram drafts take no memory of their own
    try:
        return resolve_model(spec.model)
    except (ModelConfigError, PresetError) as e:
        raise KVCalcInputError(f"--speculative-config's draft model: {e}") from None


def _lora(modules: list[str], runtime: bool, max_loras: int, max_rank: int) -> LoraShape | None:
    """The adapter slots serve run would make (engine/runner.py _attach_lora's rule)."""
    from serve.lora import lora_shape

    folders = []
    for text in modules:
        name, sep, folder = text.partition("=")
        if not sep or not name or not folder:
            raise KVCalcInputError(f"--lora-modules: an adapter is NAME=FOLDER; got {text!r}")
        folders.append(folder)
    try:
        shape = lora_shape(folders) if folders else None
    except ValueError as e:
        raise KVCalcInputError(str(e)) from None
    if max_rank and shape is not None and shape.rank > max_rank:
        raise KVCalcInputError(f"--lora-modules: an adapter has rank {shape.rank}, more than --max-lora-rank {max_rank}")
    if not runtime:
        return shape
    return LoraShape(max(max_loras or 1, len(folders)), max(max_rank or 16, shape.rank if shape else 0),
                     frozenset(LORA_TARGETS))


# The engine's measured step costs put its largest mixed step at 640 to 1,024 tokens on H100s
# (2026-11-26: Llama-3-8B 1,024; Llama-3-70B 768 at TP=2, 896 at TP=4, 640 at PP=2): its forwards
# take longer than reading the weights (attention, norms, all-reduces, launches). The roofline
# below reads the weights at this fraction of the copy bandwidth, which puts that step at 832.
WEIGHT_READ_EFFICIENCY = 0.75


@dataclass(frozen=True)
class GraphTokens:
    """The largest steps the engine's graphs capture: its piecewise graphs' and its whole-step
    graphs' (0: none)."""
    piecewise: int
    step: int


def graph_tokens(req: CalcRequest, dtype: str, max_len: int) -> GraphTokens:
    """What the engine's start-up will choose (engine/runner.py). It measures its step costs and,
    where the GPU's step sets the pace (not the host's work per round), caps its piecewise graphs at
    the largest mixed step its prompt budget allows; under TP it captures whole-step graphs only for
    steps the host paces; pipeline stages capture none. Here the same rules run on the roofline of
    the GPU's known rates; with unknown rates, the largest sizes the configuration allows."""
    # the sizes the engine times and its rule (import torch: here, not at start)
    from engine.step_graph import graph_token_limits, step_buckets

    pipeline = req.pipeline_parallel_size > 1
    rows = step_buckets(min(req.max_num_batched_tokens, max_len, COST_MAX_ROWS))
    model = None
    if req.gpu_rates is not None and len(rows) >= 2:
        copy_bw, flops = req.gpu_rates
        weights = weight_bytes_per_gpu(req.model, dtype, req.tensor_parallel_size) // req.pipeline_parallel_size
        # the largest mixed step is the one without context to read: the KV's cost does not enter
        model = StepCostModel.roofline(rows, weights, 2 * weights / DTYPE_BYTES[dtype], 0,
                                       copy_bw * WEIGHT_READ_EFFICIENCY, flops, req.max_num_batched_tokens)
    # a prompt budget where the GPU paces the steps (a pipeline stage runs no multi-step rounds)
    budgeted = model is not None and (pipeline or model.scheduler_steps(min(64, req.max_num_seqs),
                                                                         AUTO_SCHEDULER_STEPS) == 1)
    return GraphTokens(*graph_token_limits(model, budgeted, req.max_num_batched_tokens, DEFAULT_STEP_GRAPH_MAX_TOKENS,
                                           req.max_num_seqs, req.tensor_parallel_size, not pipeline))


def nccl_graph_bytes(req: CalcRequest, dtype: str, tokens: GraphTokens) -> int:
    """What NCCL holds for the collectives the graphs of a tensor-parallel rank capture
    (engine/parallel/graph_memory.py), counted as the engine counts them, on the first stage (the
    most layers), with the one-shot all-reduce over NVLink taking the small ones and the one fused
    with the norm those it measured faster for."""
    tp, pp = req.tensor_parallel_size, req.pipeline_parallel_size
    if tp == 1:
        return 0
    from engine.cuda_graph import graph_buckets
    from engine.parallel.peer_allreduce import FUSED_MAX_BYTES, ONE_SHOT_MAX_BYTES
    from engine.step_graph import graphed_token_counts

    prefill = graphed_token_counts(req.max_num_seqs, tokens.piecewise, tokens.step)
    layers = -(-req.model.num_layers // pp)
    row_bytes = req.model.hidden_size * DTYPE_BYTES[dtype]
    return NCCL_BYTES_PER_CAPTURE * nccl_captures(graph_buckets(req.max_num_seqs), prefill, row_bytes, layers, True,
                                                  pp == 1, ONE_SHOT_MAX_BYTES.get(tp, 0), FUSED_MAX_BYTES.get(tp, 0))


def plan_request(req: CalcRequest, activation_bytes: int | None = None) -> KVPlan:
    dtype = resolve_model_dtype(req.dtype, req.model)
    max_len = req.max_model_len or req.model.max_context_len
    block_size = req.block_size or default_block_size(resolve_kv_cache_dtype(req.kv_cache_dtype, dtype))
    tokens = graph_tokens(req, dtype, max_len)
    graphs = (estimate_graph_bytes(req.model, dtype, req.max_num_seqs, max_len, block_size, req.tensor_parallel_size)
              + estimate_piecewise_graph_bytes(req.model, dtype, tokens.piecewise, req.tensor_parallel_size))
    if tokens.step:
        graphs += estimate_step_graph_bytes(req.max_num_seqs, max_len, block_size, tokens.step)
    graphs += nccl_graph_bytes(req, dtype, tokens)
    if req.draft is not None:  # its decode graphs (engine/draft.py)
        graphs += estimate_graph_bytes(req.draft, dtype, req.max_num_seqs, max_len, block_size, 1)
    if req.tensor_parallel_size > 1:
        from engine.parallel.peer_allreduce import fused_buffer_bytes

        graphs += fused_buffer_bytes(req.tensor_parallel_size)
    return plan(req.model, req.gpu_memory_bytes, req.memory_utilization, req.kv_cache_dtype, req.dtype,
                block_size, req.max_model_len, req.tensor_parallel_size, activation_bytes, graphs,
                max_num_batched_tokens=req.max_num_batched_tokens, max_num_seqs=req.max_num_seqs,
                model_name=req.model_name, pipeline_parallel_size=req.pipeline_parallel_size, lora=req.lora,
                draft=req.draft)


def format_bytes(n: int) -> str:
    """Binary units, at most two decimals: 131072 -> '128 KiB', 1081344 -> '1.03 MiB'."""
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B":
        return f"{n} B"
    return f"{value:.2f}".rstrip("0").rstrip(".") + f" {unit}"


def _table_rows(base: KVPlan, block_size: int | None) -> list[KVPlan]:
    """The same budget in each KV dtype, at the given block size or else each dtype's default."""
    return [base.with_kv_dtype(d, block_size or default_block_size(d)) for d in table_kv_dtypes(base)]


def _line(label: str, value: str, note: str = "") -> str:
    return f"  {label:<30}{value:>14}" + (f"  {note}" if note else "")


def format_text(req: CalcRequest, base: KVPlan) -> str:
    per_gpu = "figures of the first GPU, which holds the draft model" if req.draft is not None else "figures per GPU"
    tp = f", tensor parallel {base.tensor_parallel_size} ({per_gpu})" if base.tensor_parallel_size > 1 else ""
    if base.pipeline_parallel_size > 1:
        tp = (f", tensor parallel {base.tensor_parallel_size} x pipeline parallel {base.pipeline_parallel_size} "
              f"(figures per GPU: a stage of {base.spec.num_layers} layers)")
    act = (f"estimate: {req.max_num_batched_tokens:,} batched tokens + CUDA runtime; --measure measures it"
           if base.activation_estimated else "measured")
    seq_len = f"{base.max_model_len:,}"
    quant = req.model.quant
    lines = [
        f"{req.model_name} on {req.gpu_label}: {format_bytes(base.gpu_memory_bytes)} x {base.memory_utilization:.2f}"
        f" = {format_bytes(base.budget_bytes)}{tp}",
        _line(f"weights ({base.dtype}{'' if quant is None else ', projections ' + quant.label.lower()})",
              format_bytes(base.weight_bytes), f"{base.num_params / 1e9:.2f}B parameters"
              + (f", {base.active_params / 1e9:.2f}B active a token" if base.active_params else "")
              + (f"; {req.lora.slots} LoRA adapter{'s' if req.lora.slots > 1 else ''} of rank up to {req.lora.rank} "
                 "included" if req.lora is not None else "")),
        *([_line("  of which the draft model", format_bytes(base.draft_weight_bytes),
                 f"{req.draft_name}, {req.draft.num_params() / 1e9:.2f}B parameters, whole on the first GPU")]
          if req.draft is not None else []),
        _line("activations", format_bytes(base.activation_bytes), act),
        _line("CUDA graphs", format_bytes(base.graph_bytes),
              "decode, piecewise and step graphs (under TP, NCCL's share too), reserved as the engine does"),
        _line("KV cache", format_bytes(base.kv_cache_bytes), base.kv_dtype),
        _line("KV bytes per token", f"{base.bytes_per_token:,}", format_bytes(base.bytes_per_token)),
        _line("KV bytes per block", f"{base.bytes_per_block:,}",
              f"{format_bytes(base.bytes_per_block)}, {base.block_size} tokens"),
        *([_line("  and the draft model's", f"{base.draft_bytes_per_block:,}",
                 f"{format_bytes(base.draft_bytes_per_block)}: its pool has as many blocks")]
          if base.draft_spec is not None else []),
        _line("blocks", f"{base.num_blocks:,}"),
        _line("tokens that fit", f"{base.max_tokens:,}"),
        _line(f"sequences of {seq_len} tokens", f"{base.max_concurrent_seqs:,}", "at once (--max-model-len)"),
        "",
        f"  {'KV dtype':<10}{'per token':>11}{'block':>7}{'per block':>11}{'blocks':>10}{'tokens':>12}"
        f"{'seqs @ ' + seq_len:>16}{'vs ' + base.dtype:>14}",
    ]
    rows = _table_rows(base, req.block_size)
    for row in rows:
        mark = "*" if row.kv_dtype == base.kv_dtype else " "
        lines.append(f"{mark} {row.kv_dtype:<10}{format_bytes(row.bytes_per_token):>11}{row.block_size:>7}"
                     f"{format_bytes(row.bytes_per_block):>11}"
                     f"{row.num_blocks:>10,}{row.max_tokens:>12,}{row.max_concurrent_seqs:>16,}"
                     f"{row.max_tokens / rows[0].max_tokens:>13.2f}x")
    lines.append("  block: tokens per KV block (each dtype's default unless --block-size is given); fp8 and int8 include")
    lines.append("  one float32 scale per token and KV head, for K and for V; * = chosen")
    return "\n".join(lines)


def read_offload_gib(args: argparse.Namespace) -> float:
    value = getattr(args, "kv_offload_gib", None)
    if value in (None, ""):
        return 0.0
    try:
        gib = float(value)
    except ValueError:
        raise KVCalcInputError(f"--kv-offload-gib must be a number of GiB; got {value!r}") from None
    if not 0 <= gib < float("inf"):
        raise KVCalcInputError(f"--kv-offload-gib must be >= 0; got {value!r}")
    return gib


def host_tier(base: KVPlan, gib: float) -> dict[str, Any]:
    """The host tier's capacity for this plan's KV layout (per GPU, like the plan's figures)."""
    blocks = host_tier_blocks(gib, base.bytes_per_block)
    return {"kv_offload_gib": gib, "host_blocks": blocks, "host_tokens": blocks * base.block_size}


def format_host_tier(base: KVPlan, gib: float) -> str:
    t = host_tier(base, gib)
    ratio = f"{t['host_tokens'] / base.max_tokens:.1f}x the GPU's tokens" if base.max_tokens else ""
    return "\n".join([_line(f"host tier ({gib:g} GiB)", f"{t['host_blocks']:,}", "blocks (--kv-offload-gib)"),
                      _line("host tier tokens", f"{t['host_tokens']:,}", ratio)])


def format_json(req: CalcRequest, base: KVPlan) -> str:
    out = {"model": req.model_name, "gpu": req.gpu_label, **base.to_dict()}
    out["table"] = [{"kv_cache_dtype": r.kv_dtype, "block_size": r.block_size, "bytes_per_token": r.bytes_per_token,
                     "bytes_per_block": r.bytes_per_block, "num_blocks": r.num_blocks,
                     "max_tokens": r.max_tokens, "max_concurrent_seqs": r.max_concurrent_seqs}
                    for r in _table_rows(base, req.block_size)]
    return json.dumps(out, indent=2)


def _run_accuracy(args: argparse.Namespace) -> int:
    """Run the model over a text with each KV dtype and print the accuracy table (serve/kv_accuracy.py)."""
    from engine.default_model import DefaultModelError
    from engine.loader import WeightLoadError
    from serve.kv_accuracy import AccuracyInputError, format_json, format_table, run_accuracy

    try:
        report = run_accuracy(args.model or None, getattr(args, "text", None), show_progress=sys.stderr.isatty())
    except (AccuracyInputError, ModelConfigError, WeightLoadError, DefaultModelError) as e:
        print(f"serve kv-calc: {e}", file=sys.stderr)
        return 2
    print(format_json(report) if args.json else format_table(report))
    return 0


def _run_measure(args: argparse.Namespace) -> int:
    """Load the model (dummy weights) on the local GPU with the engine's own sizing, and print what
    it measured and allocated next to this calculator's prediction for the same GPU."""
    import tempfile

    import torch

    if not torch.cuda.is_available():
        print("serve kv-calc: --measure needs a CUDA GPU on this machine", file=sys.stderr)
        return 2
    total = torch.cuda.mem_get_info()[1]  # without --gpu-memory the request reads this GPU (local_gpu), rates too
    planned = _plan_or_exit_code(args)
    if isinstance(planned, int):
        return planned
    req, predicted = planned
    from serve.build import build_engine

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(req.model.raw or {}))
        speculative = None
        if req.draft is not None:
            draft_dir = Path(tmp) / "draft"
            draft_dir.mkdir()
            (draft_dir / "config.json").write_text(json.dumps(req.draft.raw or {}))
            speculative = {**json.loads(args.speculative_config), "model": str(draft_dir)}
        cfg = EngineConfig(model=tmp, load_format="dummy", dtype=req.dtype, kv_cache_dtype=req.kv_cache_dtype,
                           block_size=req.block_size, max_model_len=req.max_model_len,
                           max_num_seqs=req.max_num_seqs, max_num_batched_tokens=req.max_num_batched_tokens,
                           gpu_memory_utilization=req.memory_utilization,
                           tensor_parallel_size=req.tensor_parallel_size,
                           pipeline_parallel_size=req.pipeline_parallel_size,
                           quantization="fp8" if req.model.quant == AT_LOAD else None,
                           lora_modules=tuple(m.partition("=")[::2] for m in getattr(args, "lora_modules", None) or []),
                           speculative_config=speculative)
        engine = build_engine(cfg, show_progress=False)
        runner = engine.runner  # rank 0's; the blocks are the fewest any rank holds
        # read before shutdown, which frees the graphs
        graph_pool = runner.graphs.pool_bytes if runner.graphs is not None else 0
        if runner.piecewise is not None:
            graph_pool += runner.piecewise.pool_bytes + runner.piecewise.static_bytes
        if runner.steps is not None:
            graph_pool += runner.steps.pool_bytes + runner.steps.static_bytes
        if runner.draft is not None and runner.draft.graphs is not None:
            graph_pool += runner.draft.graphs.pool_bytes
        graph_reserved = runner.graph_bytes_reserved()
        runner_steps = runner.steps is not None
        free_after_start = torch.cuda.mem_get_info()[0]
        engine.shutdown()
    measured = plan_request(req, activation_bytes=runner.activation_bytes)
    result = {
        "model": req.model_name, "gpu": torch.cuda.get_device_name(), "gpu_memory_bytes": total,
        "predicted_num_blocks": predicted.num_blocks, "allocated_num_blocks": runner.num_blocks,
        "prediction_error": predicted.num_blocks / runner.num_blocks - 1,
        "predicted_activation_bytes": predicted.activation_bytes, "measured_activation_bytes": runner.activation_bytes,
        "weight_bytes_predicted": predicted.weight_bytes, "weight_bytes_measured": runner.weight_bytes,
        "graph_bytes_reserved": predicted.graph_bytes, "graph_pool_bytes_captured": graph_pool,
        "num_blocks_with_measured_activations": measured.num_blocks,
        # where a gap comes from: the engine's own reservation and largest graphed step, the part of the
        # activations outside torch (CUDA context, NCCL), and what the budget has left once started
        "engine_graph_bytes_reserved": graph_reserved, "engine_piecewise_tokens": runner.piecewise_max_tokens,
        "engine_step_graph_tokens": runner.step_max_tokens if runner_steps else 0,
        "predicted_graph_tokens": asdict(graph_tokens(req, resolve_model_dtype(req.dtype, req.model),
                                                      req.max_model_len or req.model.max_context_len)),
        "outside_torch_bytes": runner.outside_torch_bytes, "free_bytes_after_phase": runner.free_bytes_after_phase,
        "unused_budget_bytes_after_start": free_after_start - int(total * (1 - req.memory_utilization)),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = [("weights", predicted.weight_bytes, runner.weight_bytes),
            ("activations (profile peak)", predicted.activation_bytes, runner.activation_bytes),
            ("CUDA graphs (reserved / captured)", predicted.graph_bytes, graph_pool)]
    print(f"{req.model_name} on {result['gpu']} ({format_bytes(total)}), utilization {req.memory_utilization:.2f}")
    print(f"  {'':<34}{'predicted':>14}{'measured':>14}")
    for label, p, m in rows:
        print(f"  {label:<34}{format_bytes(p):>14}{format_bytes(m):>14}")
    print(f"  {'KV blocks':<34}{predicted.num_blocks:>14,}{runner.num_blocks:>14,}"
          f"  ({result['prediction_error']:+.2%})")
    return 0


def _plan_or_exit_code(args: argparse.Namespace) -> tuple[CalcRequest, KVPlan] | int:
    """The request and its plan, or the exit code after one line on stderr: 1 when the model
    doesn't fit, 2 for bad input."""
    try:
        req = read_request(args)
        return req, plan_request(req)
    except DoesNotFitError as e:
        print(f"serve kv-calc: {e}", file=sys.stderr)
        return 1
    except (KVCalcInputError, PresetError, ModelConfigError) as e:
        print(f"serve kv-calc: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """0: printed; 1: the model doesn't fit (message on stderr); 2: bad input (message on stderr)."""
    if getattr(args, "accuracy", False):
        return _run_accuracy(args)
    if getattr(args, "measure", False):
        return _run_measure(args)
    planned = _plan_or_exit_code(args)
    if isinstance(planned, int):
        return planned
    req, base = planned
    try:
        offload_gib = read_offload_gib(args)
    except KVCalcInputError as e:
        print(f"serve kv-calc: {e}", file=sys.stderr)
        return 2
    if args.json:
        text = format_json(req, base)
        if offload_gib:
            text = json.dumps({**json.loads(text), **host_tier(base, offload_gib)}, indent=2)
        print(text)
    else:
        print(format_text(req, base))
        if offload_gib:
            print(format_host_tier(base, offload_gib))
        for warning in base.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve kv-calc", description="How many KV-cache blocks, tokens and "
                                     "sequences fit on a GPU.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
