"""The Hugging Face transformers baseline: the bench workload through `model.generate` with a static
batch, and through transformers' continuous batching `generate_batch` when it has it.

Dummy weights (from_config, bf16) on the GPU, random token-id prompts from bench.workload, greedy;
EOS is suppressed (static: min_new_tokens = max_new_tokens; continuous: eos_token_id = -1), so every
request gets its output_len tokens. Each mode runs once untimed on a small slice first (kernel
selection, allocator warm-up); the timed run covers the whole call. Reports output tok/s and the
fraction of the same roofline bound that `serve bench` uses.

  python -m bench.baseline_hf --model llama3-8b --num-prompts 64 --input-len 512 --output-len 128 \
      --result-json bench/results/hf-llama3-8b.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from serve.cli_args import OneLineErrorParser
from bench.presets import resolve_model
from bench.roofline import HardwareRates, ModelCost, estimate
from bench.workload import BenchRequest, WorkloadSpec, make_requests
from engine.config import ModelConfig, ModelConfigError

PROG = "python -m bench.baseline_hf"
MODES = ("static", "continuous")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    num_requests: int
    output_tokens: int = 0
    duration_s: float | None = None
    output_throughput: float | None = None
    roofline_output_throughput: float | None = None
    roofline_fraction: float | None = None
    error: str | None = None  # why the mode did not run


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder with config.json, or a preset name "
                                                  "(e.g. llama3-8b, qwen2.5-0.5b)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, help="static batch size (default: all prompts in one batch)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu, for a quick check on a tiny model")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV dtype the roofline assumes (default: auto)")
    p.add_argument("--copy-bandwidth", type=float, metavar="TB/s", help="roofline input instead of measuring")
    p.add_argument("--matmul-tflops", type=float, metavar="TFLOP/s", help="roofline input instead of measuring")
    p.add_argument("--result-json", metavar="PATH")
    return p


def load_dummy_model(model_dir: Path, device: str):
    """Random bf16 weights of the config's shape, created directly on the device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_static(model, requests: list[BenchRequest], batch_size: int, device: str) -> tuple[int, float]:
    """(output tokens, seconds) of `generate` over fixed batches; prompts of unequal length are
    left padded, every sequence of a batch generates the batch's longest output_len, and only the
    requested ones count."""
    import torch
    from transformers import GenerationConfig

    def generate(batch: list[BenchRequest], new_tokens: int) -> int:
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        # No padding, no mask: spares transformers building a 4D mask on every decode step (its
        # decode is bound by Python overhead on the CPU here: 20-35 ms a step for 8B on H100/H200)
        padded = any(len(r.prompt) != width for r in batch)
        cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device) if padded else None,
                                 generation_config=cfg)
        assert out.shape[1] == width + new_tokens, "generate stopped early"
        return sum(r.output_len for r in batch)

    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    generate(batches[0], 2)
    _sync(device)
    start = time.perf_counter()
    tokens = sum(generate(b, max(r.output_len for r in b)) for b in batches)
    _sync(device)
    return tokens, time.perf_counter() - start


def run_continuous(model, requests: list[BenchRequest], device: str) -> tuple[int, float]:
    """(output tokens, seconds) of transformers' continuous batching over all requests at once;
    generate_batch takes one max_new_tokens, so every request generates the longest output_len
    and, as in run_static, only the requested ones count."""
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers has no generate_batch")
    accepted = inspect.signature(model.generate_batch).parameters

    def generate(batch: list[BenchRequest], new_tokens: int) -> int:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0)
        kwargs = {"progress_bar": False} if "progress_bar" in accepted else {}
        outputs = model.generate_batch(inputs=[r.prompt for r in batch], generation_config=cfg, **kwargs)
        failed = [o.error for o in outputs.values() if getattr(o, "error", None)]
        if failed:
            raise RuntimeError(f"generate_batch: {failed[0]}")
        short = [len(o.generated_tokens) for o in outputs.values() if len(o.generated_tokens) < new_tokens]
        if len(outputs) != len(batch) or short:
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(batch)} requests, "
                               f"{len(short)} of them short")
        return sum(r.output_len for r in batch)

    generate(requests[: min(4, len(requests))], 2)
    _sync(device)
    start = time.perf_counter()
    tokens = generate(requests, max(r.output_len for r in requests))
    _sync(device)
    return tokens, time.perf_counter() - start


def _rates(args: argparse.Namespace) -> tuple[str | None, HardwareRates | None]:
    from bench.hardware import gpu_name, measure

    if args.copy_bandwidth is not None and args.matmul_tflops is not None:
        return gpu_name(), HardwareRates(args.copy_bandwidth * 1e12, args.matmul_tflops * 1e12)
    if not args.device.startswith("cuda"):
        return None, None
    m = measure()
    return m.device, m.rates()


def _validate(args: argparse.Namespace) -> tuple[Path, ModelConfig, WorkloadSpec]:
    model_dir = resolve_model(args.model)
    try:
        model = ModelConfig.from_path(model_dir)
    except ModelConfigError as e:
        raise ValueError(f"--model: {e}") from None
    ModelCost.of(model, args.kv_cache_dtype)
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    if (args.copy_bandwidth is None) != (args.matmul_tflops is None):
        raise ValueError("give both --copy-bandwidth and --matmul-tflops, or neither")
    if args.result_json and not Path(args.result_json).resolve().parent.is_dir():
        raise ValueError(f"--result-json: the folder of {args.result_json} does not exist")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no CUDA device here: pass --device cpu for a quick check on a tiny model")
    spec = WorkloadSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                        range_ratio=args.range_ratio, vocab_size=model.vocab_size, seed=args.seed)
    return model_dir, model, spec


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model_dir, model_cfg, spec = _validate(args)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    import torch
    import transformers

    gpu, rates = _rates(args)  # before the model takes the GPU's memory
    requests = make_requests(spec)
    lengths = [(len(r.prompt), r.output_len) for r in requests]
    cost = ModelCost.of(model_cfg, args.kv_cache_dtype)
    batch_size = min(args.batch_size or len(requests), len(requests))
    model = load_dummy_model(model_dir, args.device)

    results = []
    for mode in args.modes:
        bound = None
        if rates is not None:
            bound = estimate(cost, lengths, rates, concurrency=batch_size if mode == "static" else None)
        try:
            if mode == "static":
                tokens, seconds = run_static(model, requests, batch_size, args.device)
            else:
                tokens, seconds = run_continuous(model, requests, args.device)
        except Exception as e:  # a baseline that breaks is a result to report, not a crash
            results.append(ModeResult(mode, len(requests), error=f"{type(e).__name__}: {e}".splitlines()[0]))
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            continue
        throughput = tokens / seconds
        results.append(ModeResult(
            mode, len(requests), tokens, seconds, throughput,
            bound.output_throughput if bound else None,
            throughput / bound.output_throughput if bound else None))

    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "model": args.model,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "num_prompts": spec.num_prompts,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "range_ratio": spec.range_ratio,
        "seed": spec.seed,
        "batch_size": batch_size,
        "copy_bandwidth_tbs": rates.copy_bandwidth / 1e12 if rates else None,
        "matmul_tflops": rates.matmul_flops / 1e12 if rates else None,
        **{r.mode: asdict(r) for r in results},
    }
    for r in results:
        shown = "error: " + r.error if r.error else (
            f"{r.output_throughput:,.0f} out tok/s"
            + (f" ({r.roofline_fraction:.1%} of the {r.roofline_output_throughput:,.0f} tok/s bound)"
               if r.roofline_fraction is not None else ""))
        print(f"{args.model} transformers {r.mode}: {shown}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if any(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
