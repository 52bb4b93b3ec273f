"""First-use cost of step compositions: what a freshly started engine still compiles or loads.

    python -m lab.first_use --model llama3-8b --out first_use.json

Builds the engine (dummy weights) on a fresh Triton cache, so its start-up warm-up compiles what it
compiles, then launches a grid of step compositions (decode rows at various counts and contexts,
prefill chunks of various lengths, chunks after a cached prefix) through the runner, each twice.
For every step it records the wall time of the first and the second run (synchronized) and the
Triton kernels compiled during the first (name and specialization, with compile seconds). A
composition whose first run is much slower than its second is a stall that serving would hit the
first time a request mix produces it; the compile list says which variant the warm-up misses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def compositions(max_seqs: int, max_tokens: int, max_len: int) -> list[dict]:
    """(decodes, decode context, [(cached prefix, chunk)]) cases: the counts that change launch
    parameters (1, 16k, non-multiples, powers of two and their neighbours), chunk lengths around the
    prefill tile heights, and budgets filled to the last token."""
    out = []
    for nd in (0, 1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64, 100, 128, 255):
        for chunks in ([(0, 16)], [(0, 17)], [(0, 64)], [(0, 100)], [(0, 512)], [(0, 513)], [(0, 2000)]):
            out.append({"decodes": nd, "ctx": 600, "chunks": chunks})
    # budget-filling steps: many chunks, a last one cut short
    for nd in (0, 16, 48, 63):
        rest = max_tokens - nd
        n_full = rest // 512
        chunks = [(0, 512)] * n_full + ([(0, rest - 512 * n_full)] if rest % 512 else [])
        out.append({"decodes": nd, "ctx": 600, "chunks": chunks})
        out.append({"decodes": nd, "ctx": 600, "chunks": [(0, 512)] * (n_full - 1) + [(0, 333)]})
    # chunks after a cached prefix (prefix caching, chunked prefill's later chunks)
    for nd in (0, 1, 7, 32):
        out.append({"decodes": nd, "ctx": 1100, "chunks": [(1024, 128)] * 7})
        out.append({"decodes": nd, "ctx": 1100, "chunks": [(1024, 129)] * 3 + [(512, 7)]})
        out.append({"decodes": nd, "ctx": 1100, "chunks": [(1024, 1)] * 5})
    # long decode contexts
    for nd in (1, 8, 64):
        out.append({"decodes": nd, "ctx": min(max_len - 2, 4000), "chunks": [(0, 64)]})
    keep = []
    for c in out:
        c["decodes"] = min(c["decodes"], max_seqs - len(c["chunks"]))
        c["chunks"] = [(p, n) for p, n in c["chunks"] if p + n < max_len and n > 0]
        n_tok = c["decodes"] + sum(n for _, n in c["chunks"])
        if c["chunks"] and n_tok <= max_tokens and c not in keep:
            keep.append(c)
    # decode-only steps (the graphs) at a few counts
    for nd in (1, 5, 16, 24, 64, 200):
        keep.append({"decodes": min(nd, max_seqs), "ctx": 600, "chunks": []})
    return keep


def make_batch(comp: dict, block_size: int, vocab: int, next_block: list[int], num_blocks: int):
    """A Batch of fabricated sequences whose block tables point at arbitrary (reused) pages."""
    from scheduler.request import Batch, SamplingParams, ScheduledSeq, Sequence

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    items = []
    sid = 10**9 + next_block[1]
    specs = [(comp["ctx"], 1)] * comp["decodes"] + list(comp["chunks"])
    for prefix, n in specs:
        total = prefix + n
        seq = Sequence(sid, [(sid * 7 + i) % vocab for i in range(total)], params)
        sid += 1
        nb = -(-total // block_size)
        seq.block_table = [(next_block[0] + j) % num_blocks for j in range(nb)]
        next_block[0] = (next_block[0] + nb) % num_blocks
        items.append(ScheduledSeq(seq, prefix, n))
    next_block[1] = sid
    return Batch(items, comp["decodes"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-piecewise-graphs", action="store_true")
    p.add_argument("--keep-cache", action="store_true", help="use TRITON_CACHE_DIR as set (default: a fresh one)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not args.keep_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-first-use-")
    import torch
    from triton import knobs

    from serve.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, piecewise_graphs=not args.no_piecewise_graphs)
    build_s = time.perf_counter() - t0
    runner = llm.engine.runner
    compiles: list[dict] = []
    started: dict[object, float] = {}

    def before(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        started[id(key)] = time.perf_counter()
        return False

    def after(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        s = time.perf_counter() - started.pop(id(key), time.perf_counter())
        compiles.append({"kernel": fn.name, "seconds": round(s, 3), "specialization": str(key)[:600]})
        return False

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    cfg = runner.cfg
    comps = compositions(cfg.max_num_seqs, cfg.max_num_batched_tokens, runner.max_model_len)
    vocab = llm.engine.model_config.vocab_size
    cursor = [0, 0]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rows = []
    for comp in comps:
        rec = {"decodes": comp["decodes"], "ctx": comp["ctx"], "chunks": comp["chunks"]}
        for run in ("first_ms", "second_ms"):
            batch = make_batch(comp, cfg.block_size, vocab, cursor, runner.num_blocks)
            n_before = len(compiles)
            sync()
            t = time.perf_counter()
            runner.collect(runner.launch(batch))
            sync()
            rec[run] = round((time.perf_counter() - t) * 1e3, 2)
            if run == "first_ms":
                rec["compiles"] = compiles[n_before:]
        rows.append(rec)
        flag = " <-- " + ", ".join(c["kernel"] for c in rec["compiles"]) if rec["compiles"] else ""
        slow = " SLOW" if rec["first_ms"] > 3 * rec["second_ms"] + 20 else ""
        print(f"nd={rec['decodes']:3d} chunks={len(comp['chunks'])} tok={sum(n for _, n in comp['chunks']):5d} "
              f"first {rec['first_ms']:8.1f} ms second {rec['second_ms']:7.1f} ms{slow}{flag}", flush=True)
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    slow = [r for r in rows if r["first_ms"] > 3 * r["second_ms"] + 20]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
               "model": args.model, "build_s": round(build_s, 1),
               "compositions": len(rows), "slow_first_runs": len(slow),
               "compiles_after_warmup": sum(len(r["compiles"]) for r in rows),
               "first_ms_total": round(sum(r["first_ms"] for r in rows), 1),
               "second_ms_total": round(sum(r["second_ms"] for r in rows), 1)}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "steps": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
