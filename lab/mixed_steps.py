"""Host and GPU time of mixed steps (decodes + new prompts' prefill), as serving sees them.

    python -m lab.mixed_steps --model qwen2.5-0.5b --decodes 58 --prompts 6 --out mixed.json

`serve bench --concurrency 64` replaces finished requests at once, so most steps with prefill
tokens carry ~60 decodes next to a few new prompts. An offline run (all prompts at once) has no
such steps; this one makes them: `--decodes` sequences keep decoding while every round adds
`--prompts` prompts of `--input-len` tokens that finish after their first token, then runs
`--decode-steps` decode steps (`--shared-prefix N`: the new prompts share their first N tokens, so that
their chunks follow a cached prefix). The engine core steps as in serving (async scheduling on a GPU).
Each launch is timed on the host; with --sync the GPU is drained before and after it, so
launch_ms is the host's own time and gpu_ms (CUDA events) the step's GPU time alone.
--cprofile profiles the mixed steps' launches only.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import random
import statistics
import sys
import time
from pathlib import Path

from lab.profiling import write_top


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--decodes", type=int, default=58)
    p.add_argument("--prompts", type=int, default=6, help="new prompts per mixed step")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="the new prompts of the rounds start with the same N tokens (cached after the first): "
                        "their chunks come after a cached prefix")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seed", type=int, default=0,
                   help="of the prompts' token ids: runs on one engine with other seeds find nothing of the "
                        "last run's prompts in its prefix cache")
    p.add_argument("--decode-steps", type=int, default=2, help="decode-only steps between mixed steps")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--no-piecewise-graphs", action="store_true")
    p.add_argument("--step-graph-max-tokens", type=int, default=None,
                   help="the engine's option (engine/step_graph.py); 0: piecewise graphs only")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch without PDL, so that a profile's kernel times do not overlap")
    p.add_argument("--cprofile", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--torch-profile", default=None,
                   help="then 5 mixed steps in a row under torch.profiler, with --sync: their kernel table here")
    args = p.parse_args(argv)

    import torch

    from scheduler.request import SamplingParams
    from serve.llm import LLM

    steps = {} if args.step_graph_max_tokens is None else {"step_graph_max_tokens": args.step_graph_max_tokens}
    llm = LLM(args.model, load_format=args.load_format, max_num_batched_tokens=args.max_num_batched_tokens,
              piecewise_graphs=not args.no_piecewise_graphs, pdl=False if args.no_pdl else None, **steps)
    core, runner = llm.engine.core, llm.engine.runner
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(args.seed)
    prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    shared = prompt(args.shared_prefix)
    cuda = torch.cuda.is_available()
    prof = cProfile.Profile() if args.cprofile else None
    records: list[dict] = []
    launch, prepare = runner.launch, runner.prepare

    def timed_prepare(*a, **kw):
        t = time.perf_counter()
        out = prepare(*a, **kw)
        if records:
            records[-1]["prepare_ms"] = (time.perf_counter() - t) * 1e3
        return out

    def timed_launch(batch, prev=None):
        mixed = batch.num_decode != len(batch.items)
        rec = {"mixed": mixed, "decodes": batch.num_decode, "tokens": batch.num_tokens}
        if args.sync and cuda:
            torch.cuda.synchronize()
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if ev:
            ev[0].record()
        records.append(rec)
        t0 = time.perf_counter()
        if prof is not None and mixed:
            prof.enable()
        handle = launch(batch, prev)
        if prof is not None and mixed:
            prof.disable()
        rec["launch_ms"] = (time.perf_counter() - t0) * 1e3
        if ev:
            ev[1].record()
        if args.sync and cuda:
            torch.cuda.synchronize()
            rec["total_ms"] = (time.perf_counter() - t0) * 1e3
        rec["t0"], rec["_ev"] = t0, ev
        return handle

    long = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def fill() -> None:
        for _ in range(args.decodes):
            core.add_request(prompt(args.input_len), long)
        while core.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running):
            core.step()

    def rounds(n: int, decode_steps: int) -> None:
        for _ in range(n):
            for _ in range(args.prompts):
                core.add_request(shared + prompt(args.input_len), one)
            for _ in range(1 + decode_steps):
                core.step()

    def drain() -> None:
        for s in list(core.scheduler.running) + list(core.scheduler.waiting):
            core.abort(s.seq_id)
        while core.has_unfinished():
            core.step()

    def run(n: int) -> None:
        fill()
        rounds(n, args.decode_steps)
        drain()

    run(3)  # warm-up
    runner.launch, runner.prepare = timed_launch, timed_prepare
    hits = core.scheduler.prefix_cache_hits
    t_start = time.perf_counter()
    run(args.rounds)
    wall = time.perf_counter() - t_start
    runner.launch, runner.prepare = launch, prepare
    if cuda:
        torch.cuda.synchronize()
    for i, rec in enumerate(records):
        ev = rec.pop("_ev")
        if ev:
            rec["gpu_ms"] = ev[0].elapsed_time(ev[1])
        nxt = records[i + 1]["t0"] if i + 1 < len(records) else None
        rec["interval_ms"] = (nxt - rec["t0"]) * 1e3 if nxt else None
    for rec in records:
        rec.pop("t0")

    def summary(rs: list[dict]) -> dict:
        out: dict = {"steps": len(rs)}
        for key in ("launch_ms", "prepare_ms", "gpu_ms", "total_ms", "interval_ms"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                out[key] = {"median": statistics.median(vals), "mean": statistics.fmean(vals), "max": max(vals)}
        return out

    mixed = [r for r in records if r["mixed"] and r["decodes"] == args.decodes]
    result = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "model": llm.engine.model_name,
              "decodes": args.decodes, "prompts": args.prompts, "input_len": args.input_len,
              "sync": args.sync, "piecewise_graphs": runner.piecewise is not None,
              "step_graphs": runner.steps is not None, "wall_s": wall,
              "prefix_cache_hits": core.scheduler.prefix_cache_hits - hits,
              "mixed": summary(mixed), "decode_only": summary([r for r in records if not r["mixed"]])}
    print(json.dumps(result, indent=1))
    if prof is not None:
        write_top(prof, args.cprofile, 40)
    if args.out:
        Path(args.out).write_text(json.dumps(result | {"records": records}, indent=1))
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        args.sync = True
        runner.launch = timed_launch
        fill()
        rounds(2, 0)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as tprof:
            rounds(5, 0)  # mixed steps only
        drain()
        runner.launch = launch
        Path(args.torch_profile).write_text(tprof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
    return 0


if __name__ == "__main__":
    sys.exit(main())
