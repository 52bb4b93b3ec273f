"""Per-step timing of an offline run: where each step's wall time goes, by kind of step.

    python -m lab.steps --model qwen2.5-0.5b --max-num-batched-tokens 512 --out steps.json

Wraps the model runner's launch() and collect(): for every step it records the batch (decode
rows, prefill tokens), the host time spent launching it, the time collect() waited for its
tokens, and its device time between CUDA events recorded at the start and the end of the launch
(on an idle-free stream this is the GPU time; if the host enqueues slower than the GPU runs, the
GPU waits inside it and it grows). It also counts Triton compiles during the timed run (new
entries in a fresh TRITON_CACHE_DIR): a compile in the middle of serving stalls every request.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lab.profiling import cprofile_to


def _count_cache(d: Path) -> int:
    return sum(1 for _ in d.iterdir()) if d.exists() else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--no-piecewise-graphs", action="store_true", help="launch steps with prefill tokens eagerly")
    p.add_argument("--out", default=None, help="write the per-step records and the summary here (JSON)")
    p.add_argument("--cprofile", default=None, help="write cProfile's top functions of the timed run here")
    p.add_argument("--sync", action="store_true",
                   help="wait for the GPU before and after each launch: host_ms is the launch's own host time "
                        "with an empty queue, total_ms what the step takes alone")
    p.add_argument("--torch-profile", default=None,
                   help="write torch.profiler's kernel table of the timed run here (with --sync: steps don't overlap)")
    args = p.parse_args(argv)

    # a cache kept between runs saves the compiles; new entries during the timed run are counted
    cache = Path(os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-steps-")))
    import torch

    from kernels.launch import stats as kstats
    from serve.llm import LLM
    from scheduler.request import SamplingParams

    llm = LLM(args.model, load_format=args.load_format, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, async_scheduling=False if args.no_async_scheduling else None,
              piecewise_graphs=not args.no_piecewise_graphs)
    runner = llm.engine.runner
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    make = lambda: [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]  # noqa: E731
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(make(), params)  # warm-up: the same shapes
    compiled_before = _count_cache(cache)

    records: list[dict] = []
    cuda = torch.cuda.is_available()
    launch, collect = runner.launch, runner.collect

    def timed_launch(batch, prev=None):
        rec = {"decodes": batch.num_decode, "tokens": batch.num_tokens, "seqs": len(batch.items)}
        if args.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if cuda:
            rec["_ev"] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            rec["_ev"][0].record()
        specs = sum(n for n, _ in kstats().values())
        handle = launch(batch, prev)
        rec["new_specializations"] = sum(n for n, _ in kstats().values()) - specs
        if cuda:
            rec["_ev"][1].record()
        rec["launch_ms"] = (time.perf_counter() - t0) * 1e3
        rec["t_launch"] = t0
        if args.sync:
            torch.cuda.synchronize()
            rec["total_ms"] = (time.perf_counter() - t0) * 1e3
        records.append(rec)
        handle._rec = rec
        return handle

    def timed_collect(handle):
        t0 = time.perf_counter()
        out = collect(handle)
        handle._rec["collect_wait_ms"] = (time.perf_counter() - t0) * 1e3
        return out

    runner.launch, runner.collect = timed_launch, timed_collect
    if not runner.overlap:
        runner.execute = lambda batch: timed_collect(timed_launch(batch))
    prompts = make()
    with cprofile_to(args.cprofile):
        tprof = None
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            tprof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            tprof.__enter__()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        if tprof is not None:
            tprof.__exit__(None, None, None)
            Path(args.torch_profile).write_text(
                tprof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45) + "\n\n"
                + tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))
    runner.launch, runner.collect = launch, collect
    if cuda:
        torch.cuda.synchronize()
    for i, rec in enumerate(records):
        if "_ev" in rec:
            a, b = rec.pop("_ev")
            rec["gpu_ms"] = a.elapsed_time(b)
        nxt = records[i + 1]["t_launch"] if i + 1 < len(records) else None
        rec["interval_ms"] = (nxt - rec["t_launch"]) * 1e3 if nxt else None
    for rec in records:
        rec.pop("t_launch")

    def summary(rs: list[dict]) -> dict:
        out = {"steps": len(rs), "tokens": sum(r["tokens"] for r in rs)}
        out["new_specializations"] = sum(r["new_specializations"] for r in rs)
        for key in ("launch_ms", "total_ms", "collect_wait_ms", "gpu_ms", "interval_ms"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                out[key] = {"mean": statistics.fmean(vals), "median": statistics.median(vals),
                            "max": max(vals), "sum": sum(vals)}
        return out

    decode = [r for r in records if r["decodes"] == r["seqs"]]
    mixed = [r for r in records if r["decodes"] != r["seqs"]]
    result = {"model": llm.engine.model_name, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
              "piecewise_graphs": runner.piecewise is not None,
              "max_num_batched_tokens": args.max_num_batched_tokens, "async_scheduling": runner.overlap,
              "wall_s": wall, "triton_compiles_in_run": _count_cache(cache) - compiled_before,
              "decode_only": summary(decode), "with_prefill": summary(mixed), "records": records}
    brief = {k: v for k, v in result.items() if k != "records"}
    print(json.dumps(brief, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
