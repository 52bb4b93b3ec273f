"""Greedy output of LLM(tensor_parallel_size=N) against N=1 on the GPU, each size in its own
process, the same dummy-weight model (the same seed gives every rank its part of one model).

    python -m lab.tp_check --model .models/qwen2.5-0.5b --sizes 1,2 --out tp_check.json

bf16 matmuls split over ranks sum in another order, so near-ties may flip a token; the report gives
how many sequences match exactly and where the others first differ.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path


def run_one(model: str, size: int, prompts: int, input_len: int, output_len: int, dtype: str) -> list[list[int]]:
    from scheduler.request import SamplingParams
    from serve.llm import LLM

    with LLM(model, load_format="dummy", tensor_parallel_size=size, dtype=dtype) as llm:
        rng = random.Random(0)
        vocab = llm.engine.model_config.vocab_size
        ids = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(prompts)]
        outs = llm.generate(ids, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
        return [list(o.token_ids) for o in outs]


def agreement(outs: list[list[int]], base: list[list[int]]) -> dict:
    """How many sequences equal the reference's exactly, and where each other one first differs."""
    firsts = [next((i for i, (x, y) in enumerate(zip(o, b)) if x != y), None) for o, b in zip(outs, base)]
    return {"equal": sum(f is None for f in firsts), "first_differences": [f for f in firsts if f is not None]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.tp_check")
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=None)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this size only
    a = p.parse_args(argv)
    if a.one is not None:
        print(json.dumps(run_one(a.model, a.one, a.prompts, a.input_len, a.output_len, a.dtype)))
        return 0
    runs = {}
    for size in (int(s) for s in a.sizes.split(",")):
        cmd = [sys.executable, "-m", "lab.tp_check", "--model", a.model, "--one", str(size), "--prompts", str(a.prompts),
               "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--dtype", a.dtype]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"size {size} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        runs[size] = json.loads(done.stdout.strip().splitlines()[-1])
    base = runs[min(runs)]
    report = {"model": a.model, "dtype": a.dtype, "prompts": a.prompts, "input_len": a.input_len, "output_len": a.output_len}
    for size, outs in runs.items():
        report[f"tp{size}"] = agreement(outs, base)
    print(json.dumps(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
