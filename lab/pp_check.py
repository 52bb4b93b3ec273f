"""Pipeline parallelism on the GPU: greedy output of LLM(pipeline_parallel_size=N) against one GPU,
each layout in its own process on the same dummy-weight model (the same seed gives every stage its
layers of one model), and the decode rate: `batch` sequences of `context` prompt tokens decoding
together, timed over `steps` engine steps once every prompt is in.

    python -m lab.pp_check --model Llama-3-8B --layouts 1x1,1x2 --out pp_check.json

A layout is TPxPP, with an "e" after it for --enforce-eager (no CUDA graphs) and an "n" for
--disable-custom-all-reduce (every all-reduce through NCCL), e.g. 1x2e, 2x1n. bf16 sums run in the same order on one GPU and on stages (the layers are the
same kernels), so outputs should match; a near-tie may still flip a token where batch shapes
differ (two micro-batches of half the rows): the report gives how many sequences match exactly
and where the others first differ. Decode: ms per engine step (one micro-batch of about
batch / PP rows while the other stages work on the others) and output tokens per second.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from lab.tp_check import agreement


def apply_variant(variant: dict) -> None:
    """A lab variant of the decode attention, in this process only (one-GPU layouts: TP/PP ranks
    are processes of their own): "decode" overrides keys of decode_config()'s plan; "unfused_rotary"
    runs the rotary embedding and the KV write as their own kernel before decode attention."""
    from kernels import fused, paged_attention as pa

    if variant.get("decode"):
        plan = pa.decode_config
        pa.decode_config = lambda *args, **kw: {**plan(*args, **kw), **variant["decode"]}
    if variant.get("unfused_rotary"):
        def unfused(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                    softmax_scale, out=None, config=None, reuse=None, pdl=False):
            q, _ = fused.apply_rotary(q, k, positions, cos_sin, v, k_cache, v_cache, slot_mapping, pdl=pdl)
            return pa.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out=out,
                                             config=config, reuse=reuse, pdl=pdl)
        pa.rotary_decode_attention = unfused


def run_one(model: str, layout: str, a: argparse.Namespace, emit: bool = False) -> dict:
    from scheduler.request import SamplingParams
    from serve.llm import LLM

    if a.variant:
        apply_variant(json.loads(a.variant))

    shape, flags = layout.rstrip("en"), layout[len(layout.rstrip("en")):]
    tp, pp = (int(x) for x in shape.split("x"))
    kw = dict(load_format="dummy", tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=a.dtype,
              enforce_eager="e" in flags, disable_custom_all_reduce="n" in flags,
              gpu_memory_utilization=a.gpu_memory_utilization)
    with LLM(model, **kw) as llm:
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(0)
        ids = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.prompts)]
        outs = llm.generate(ids, SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True))
        greedy = [list(o.token_ids) for o in outs]

        core = llm.engine.core
        params = SamplingParams(max_tokens=a.steps * 4 + 64, temperature=0, ignore_eos=True)
        seqs = [core.add_request([rng.randrange(vocab) for _ in range(a.context)], params) for _ in range(a.batch)]
        while any(s.num_output_tokens < 2 for s in seqs):  # every prompt in, every sequence decoding
            core.step()
        for _ in range(8):  # warm: graphs replayed, the queue full
            core.step()
        before = core.stats.generation_tokens
        t0 = time.perf_counter()
        for _ in range(a.steps):
            core.step()
        elapsed = time.perf_counter() - t0
        tokens = core.stats.generation_tokens - before
        kernels = kernel_profile(core, a.profile_steps, a.batch) if a.kernel_profile else None
        mixed = mixed_profile(core, a, rng, vocab) if a.mixed_tokens else None
        for s in seqs:
            core.abort(s.seq_id)
        while core.has_unfinished():
            core.step()
        result = {"greedy": greedy, "step_ms": elapsed / a.steps * 1e3, "decode_tok_s": tokens / elapsed,
                  "max_in_flight": core.stats.max_in_flight, "num_blocks": llm.engine.runner.num_blocks,
                  "startup_s": llm.engine.runner.startup_s,
                  "decode_step_ms": a.batch / (tokens / elapsed) * 1e3,  # one token for each of the batch
                  "peer_all_reduce": llm.engine.runner.comm.peer is not None}
        if kernels is not None:
            result["kernels"] = kernels
        if mixed is not None:
            result["mixed"] = mixed
        if emit:  # before the engine stops: a stop that hangs still leaves the figures
            print(json.dumps(result), flush=True)
        return result


def mixed_profile(core, a: argparse.Namespace, rng: random.Random, vocab: int) -> dict:
    """Steps that carry the decoding batch and a new prompt of --mixed-tokens tokens each (as a
    mixed step of serving does): their wall time with the GPU drained around each, and rank 0's
    GPU kernels by device time per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from scheduler.request import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def mixed_step() -> float:
        core.add_request([rng.randrange(vocab) for _ in range(a.mixed_tokens)], one)
        sync()
        t0 = time.perf_counter()
        core.step()
        sync()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):  # warm: this step size's graphs replayed once
        mixed_step()
    walls = sorted(mixed_step() for _ in range(a.profile_steps))
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        for _ in range(a.profile_steps):
            mixed_step()
    rows = _kernel_rows(prof, a.profile_steps)
    return {"prompt_tokens": a.mixed_tokens, "step_ms_median": walls[len(walls) // 2],
            "kernel_us_per_step": sum(r["us_per_step"] for r in rows), "kernels": rows[:40]}


def kernel_profile(core, steps: int, batch: int) -> list[dict]:
    """GPU kernels of this process (rank 0) over `steps` engine steps, by device time per model step
    (a token for each of the `batch` rows; an engine step may be a round of several): what a decode
    step's time goes to, graph replays included (CUPTI reports the kernels inside them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    before = core.stats.generation_tokens
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    model_steps = max(1, round((core.stats.generation_tokens - before) / batch))
    return _kernel_rows(prof, model_steps)[:40]


def _kernel_rows(prof, steps: int) -> list[dict]:
    """A torch.profiler run's kernels with device time, by device time per step, the largest first."""
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if us > 0:
            rows.append({"kernel": ev.key[:160], "calls": ev.count, "us_per_step": us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.pp_check")
    p.add_argument("--model", required=True, help="a model folder or preset (dummy weights)")
    p.add_argument("--layouts", default="1x1,1x2,1x2e", help="TPxPP[e][n] layouts, the first is the reference")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="decoding sequences in the timed steps")
    p.add_argument("--context", type=int, default=512, help="their prompt tokens")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--layout-timeout", type=float, default=300, help="seconds a layout's process may take")
    p.add_argument("--kernel-profile", action="store_true", help="rank 0's GPU kernels over --profile-steps steps")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--mixed-tokens", type=int, default=0,
                   help="also profile steps that carry a new prompt of this many tokens beside the decodes")
    p.add_argument("--variant", default="", help="JSON: a lab variant of decode attention (apply_variant; one GPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: this layout only
    a = p.parse_args(argv)
    if a.one is not None:
        run_one(a.model, a.one, a, emit=True)
        return 0
    runs = {}
    for layout in a.layouts.split(","):
        cmd = [sys.executable, "-m", "lab.pp_check", "--model", a.model, "--one", layout]
        for flag in ("prompts", "input_len", "output_len", "batch", "context", "steps", "dtype", "gpu_memory_utilization",
                     "profile_steps", "mixed_tokens"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
        cmd += ["--kernel-profile"] if a.kernel_profile else []
        cmd += ["--variant", a.variant] if a.variant else []
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.layout_timeout)
            out, err, code = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:  # its figures, if it printed them; the next layouts still run
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
            code = None
            print(f"layout {layout} ran past {a.layout_timeout:.0f} s:\n{err[-2000:]}", file=sys.stderr)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines:
            print(f"layout {layout} failed:\n{err[-3000:]}", file=sys.stderr)
            if code not in (None, 0):
                return 1
            continue
        runs[layout] = json.loads(lines[-1])
        print(layout, {k: v for k, v in runs[layout].items() if k not in ("greedy", "kernels", "mixed")}, flush=True)
        for row in runs[layout].get("kernels", [])[:15]:
            print(f"  {row['us_per_step']:9.1f} us/step {row['calls']:6d}  {row['kernel'][:110]}", flush=True)
        if "mixed" in runs[layout]:
            m = runs[layout]["mixed"]
            print(f"  mixed steps (+{m['prompt_tokens']} prompt tokens): {m['step_ms_median']:.2f} ms, "
                  f"kernels {m['kernel_us_per_step'] / 1e3:.2f} ms", flush=True)
            for row in m["kernels"][:20]:
                print(f"  {row['us_per_step']:9.1f} us/step {row['calls']:6d}  {row['kernel'][:110]}", flush=True)
    if a.layouts.split(",")[0] not in runs:
        print("the reference layout did not finish", file=sys.stderr)
        return 1
    base = runs[a.layouts.split(",")[0]]["greedy"]
    report = {k: getattr(a, k) for k in ("model", "dtype", "prompts", "input_len", "output_len", "batch", "context", "steps")}
    for layout, run in runs.items():
        report[layout] = {**agreement(run["greedy"], base), **{k: v for k, v in run.items() if k != "greedy"}}
    print(json.dumps(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
