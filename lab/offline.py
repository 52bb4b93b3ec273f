"""Offline engine throughput: LLM.generate over random token-id prompts, against the roofline.

python -m lab.offline --model llama3-8b --load-format dummy --num-prompts 64 \
    --input-len 512 --output-len 128 [--enforce-eager] [--profile out.txt] [--result-json PATH]

No HTTP in the way: this isolates the engine (scheduler, runner, kernels, graphs) from the server.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from bench.hardware import measure
from bench.roofline import ModelCost, estimate
from lab.kernels import write_json


def time_decode(llm, prompts: list[list[int]], params, profile_path: str | None = None) -> tuple[int, float, int]:
    """Steps the engine until every sequence has its first token (all prefills done), then times
    the steps in which all of them decode, up to the first that finishes: (decoded tokens,
    seconds, steps) of pure decode at the full batch. With profile_path, torch.profiler records
    the first 10 of those steps instead (then untimed). Aborts what is left at the end. params: one
    SamplingParams for all, or one per prompt."""
    import torch

    core = llm.engine.core
    plist = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [core.add_request(ids, p) for ids, p in zip(prompts, plist)]
    started: set[int] = set()
    while len(started) < len(prompts):
        for out in core.step():
            if out.new_token_ids:
                started.add(out.seq_id)
            if out.finished:
                raise ValueError("a sequence finished during the prefills: raise --output-len")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    if profile_path:
        write_profile(profile_path, lambda: [core.step() for _ in range(10)])
    n, launched, t0 = 0, core.stats.num_steps, time.perf_counter()
    done = False
    while not done and core.has_unfinished():
        outs = core.step()
        n += sum(len(out.new_token_ids) for out in outs)
        done = any(out.finished for out in outs)
    sync()
    elapsed = time.perf_counter() - t0
    steps = core.stats.num_steps - launched  # launched (a call that only collects a step launches none)
    for seq in seqs:
        core.abort(seq.seq_id)
    return n, elapsed, steps


def write_profile(path: str, fn) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true", help="wait for each step before scheduling the next")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="programmatic dependent launch (kernels/pdl.py; default: where the GPU can)")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode steps per scheduling round (default: the engine's)")
    p.add_argument("--decode-only", action="store_true",
                   help="time only the steps in which every sequence decodes (all prefills done): "
                        "the decode throughput at batch --num-prompts and context --input-len")
    p.add_argument("--repeat", type=int, default=1, help="timed runs (new prompts each); the median is reported")
    p.add_argument("--profile", default=None, help="write a torch.profiler table of a run to this file")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)

    hw = measure()
    from serve import LLM, SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              **({} if args.block_size is None else {"block_size": args.block_size}),
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              enable_prefix_caching=not args.no_prefix_caching,
              async_scheduling=False if args.no_async_scheduling else None, pdl=args.pdl,
              **({} if args.num_scheduler_steps is None else {"num_scheduler_steps": args.num_scheduler_steps}))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    # Warm-up over the same shapes (Triton compiles a kernel variant per tile configuration), with
    # other tokens so that the prefix cache holds nothing of the measured prompts.
    warm = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    import torch

    if args.decode_only:
        runs = []
        for r in range(args.repeat):
            ps = prompts if r == 0 else [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in prompts]
            runs.append(time_decode(llm, ps, params))
        n_out, elapsed, steps = sorted(runs, key=lambda x: x[0] / x[1])[len(runs) // 2]
        repeats = [x[0] / x[1] for x in runs]
    else:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        n_out = sum(len(o.token_ids) for o in outs)
        steps = llm.engine.core.stats.num_steps
    result = dict(decode_only=args.decode_only, repeat_throughputs=repeats if args.decode_only else None, model=llm.engine.model_name, gpu=hw.device, num_prompts=args.num_prompts,
                  input_len=args.input_len, output_len=args.output_len, enforce_eager=args.enforce_eager,
                  async_scheduling=llm.engine.runner.overlap, pdl=llm.engine.runner.pdl,
                  num_scheduler_steps=llm.engine.runner.num_scheduler_steps, kv_cache_dtype=llm.engine.runner.kv_spec.dtype, duration_s=elapsed,
                  output_throughput=n_out / elapsed, steps=steps,
                  date=time.strftime("%Y-%m-%d"))
    rates = hw.rates()
    if rates is not None:
        cost = ModelCost.of(llm.engine.model_config, args.kv_cache_dtype)
        est = estimate(cost, [(args.input_len, args.output_len)] * args.num_prompts, rates, concurrency=args.max_num_seqs)
        if args.decode_only:  # the bound of the timed steps alone: decode steps at the bound
            result.update(roofline_output_throughput=args.num_prompts / est.decode_step_s,
                          roofline_fraction=(n_out / elapsed) * est.decode_step_s / args.num_prompts,
                          decode_step_ms=elapsed / max(steps, 1) * 1e3,
                          roofline_decode_step_ms=est.decode_step_s * 1e3,
                          copy_bandwidth=rates.copy_bandwidth, matmul_flops=rates.matmul_flops)
        else:
            result.update(roofline_output_throughput=est.output_throughput,
                          roofline_fraction=(n_out / elapsed) / est.output_throughput,
                          roofline_decode_step_ms=est.decode_step_s * 1e3, roofline_prefill_s=est.prefill_s,
                          copy_bandwidth=rates.copy_bandwidth, matmul_flops=rates.matmul_flops)
    if args.profile and args.decode_only:
        time_decode(llm, [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in prompts],
                    SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True), args.profile)
    elif args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            llm.generate(prompts[: min(len(prompts), args.max_num_seqs)], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=40))
            f.write("\n\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    print(json.dumps(result))
    write_json(args.result_json, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
