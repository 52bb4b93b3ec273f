"""The sampler's device time: sample_on_device on [rows, vocabulary] bf16 logits, greedy and sampled
(temperature, top-p), for this tree and, with --against DIR, another tree's engine/sampler.py in the
same process. CUDA events around each call, warmed up, median of --reps.

    python -m lab.sampling [--rows 64] [--vocab 49152,151936] [--against DIR] [--out FILE]
    python -m lab.sampling --sweep 4096x8,8192x16 ...   kernels/sample.py's block and warps, sampled rows
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from scheduler.request import SamplingParams

PARAMS = {"greedy": SamplingParams(temperature=0.0), "t0.8": SamplingParams(temperature=0.8),
          "t0.8-p0.95": SamplingParams(temperature=0.8, top_p=0.95),
          "t0.8-p0.95-seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1)}


def _sampler(tree: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"sampler_{abs(hash(str(tree)))}", tree / "engine" / "sampler.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def time_us(mod: Any, logits: torch.Tensor, params: SamplingParams, reps: int) -> float:
    n = logits.shape[0]
    gen = torch.Generator(device=logits.device).manual_seed(0)
    batch = mod.SamplingBatch([params] * n, list(range(n)))
    for _ in range(3):
        mod.sample_on_device(logits, batch, gen)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        mod.sample_on_device(logits, batch, gen)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def sweep(args: argparse.Namespace) -> int:
    from kernels.sample import sample_rows

    rows = []
    for vocab in map(int, args.vocab.split(",")):
        x = (torch.randn(args.rows, vocab, device="cuda") * 3).to(torch.bfloat16)
        n = args.rows
        for top_p in (1.0, 0.95):
            params = (torch.full((n,), 0.8, device="cuda"), torch.full((n,), vocab, dtype=torch.int32, device="cuda"),
                      torch.full((n,), top_p, device="cuda"), torch.arange(n, dtype=torch.int64, device="cuda"))
            for cfg in args.sweep.split(","):
                block, warps = map(int, cfg.split("x"))
                for _ in range(3):
                    sample_rows(x, *params, block=block, num_warps=warps)
                times = []
                for _ in range(args.reps):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    sample_rows(x, *params, block=block, num_warps=warps)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3)
                row = {"vocab": vocab, "top_p": top_p, "block": block, "warps": warps, "us": round(statistics.median(times), 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "sweep": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.sampling", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", default="49152,151936")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--against", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--sweep", help="BLOCKxWARPS,... of kernels/sample.py, timed on the sampled settings")
    args = p.parse_args(argv)
    if args.sweep:
        return sweep(args)
    trees = {"this": _sampler(Path.cwd())}
    if args.against:
        trees["against"] = _sampler(args.against)
    rows = []
    for vocab in map(int, args.vocab.split(",")):
        logits = (torch.randn(args.rows, vocab, device="cuda") * 3).to(torch.bfloat16)
        for name, params in PARAMS.items():
            row: dict[str, Any] = {"rows": args.rows, "vocab": vocab, "params": name}
            for label, mod in trees.items():
                row[f"{label}_us"] = round(time_us(mod, logits, params, args.reps), 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
