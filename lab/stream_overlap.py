"""Does a prompt's prefill hide beside a small model's decode steps on a second CUDA stream?

    python -m lab.stream_overlap --model qwen2.5-0.5b --out F

A small model's decode step is a chain of latency-bound kernels (Qwen2.5-0.5B: ~170 kernels of
3-13 us, each on a few SMs, none at half the copy bandwidth; bench/NOTES.md, 2026-11-24), so the
GPU idles through most of it, while a prefill of a few hundred tokens is a few large matmuls. A
mixed step puts both in the same kernels, where the prompt rows cost as much per token as a large
prefill (the cost model's curve). This probe runs them side by side instead: K replays of a
64-row decode graph (the engine's model and kernels, contexts of --context tokens, each sequence
its own pages) on one stream and a prefill of N prompt tokens (chunks of --chunk) on
another (also a CUDA graph), each alone and both at once, with the decode stream at a higher
priority or the same. A sleep kernel holds both streams until the host has queued both.
Writes one JSON (GPU name, date): per (N, K) the medians of decode alone, prefill alone, both
(end of the decode part and end of all), and the share of the prefill hidden.

`--halves` asks another question of the same set-up: does the decode step run faster as two
steps of half the sequences each on two streams at once, whose latency-bound kernels would share
the SMs (2026-11-27, Qwen2.5-0.5B: 1.23 against 1.07 ms at 64 rows, 1.36 against 1.42 at 128)?
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.stream_overlap", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--context", type=int, default=576)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--tokens", default="256,512,1024,2048", help="prefill sizes N")
    p.add_argument("--steps", default="1,2,4", help="decode replays K")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--halves", action="store_true",
                   help="instead: the decode step of --decodes rows against two steps of half the rows each "
                        "(every other sequence) on two streams at once")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import torch

    from engine.attention import AttnMetadata
    from serve.llm import LLM

    llm = LLM(a.model, load_format="dummy")
    runner = llm.engine.runner
    model, ops, caches = runner.model, runner.ops, runner.pool.layers
    dev = runner.device
    bs = runner.kv_spec.block_size
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    next_block = 1  # block 0 stays free

    def blocks(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-n_tokens // bs)
        out = list(range(next_block, next_block + n))
        next_block += n
        return out

    def table(rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=dev)

    def decode_fn(ids: torch.Tensor, tabs: list[list[int]], tokens: torch.Tensor):
        """The decode step of len(ids) sequences at `context` tokens (the last one new) on pages
        tabs, its greedy tokens into `tokens`."""
        n, c = len(ids), a.context
        meta = AttnMetadata(
            slot_mapping=torch.tensor([t[(c - 1) // bs] * bs + (c - 1) % bs for t in tabs], device=dev),
            block_tables=table(tabs), seq_lens=torch.full((n,), c, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev), num_decode=n, max_query_len=1)
        pos = torch.full((n,), c - 1, dtype=torch.int64, device=dev)
        last = torch.arange(n, device=dev)

        def decode() -> None:
            out = model(ops, ids, pos, caches, meta, last, None, gather=False)
            model.greedy_tokens(ops, out, tokens)
        return decode

    # the decode step: D sequences at `context` tokens, each its own pages
    D = a.decodes
    dtab = [blocks(a.context) for _ in range(D)]
    d_ids = torch.randint(vocab, (D,), generator=g).to(dev)
    d_tokens = torch.zeros(D, dtype=torch.int64, device=dev)
    decode = decode_fn(d_ids, dtab, d_tokens)
    if a.halves:
        h_tokens = [torch.zeros_like(d_tokens[i::2]) for i in (0, 1)]
        return halves(a, decode, d_tokens, [decode_fn(d_ids[i::2].clone(), dtab[i::2], h_tokens[i]) for i in (0, 1)],
                      h_tokens)

    def prefill_fn(n: int):
        lens = [min(a.chunk, n - i) for i in range(0, n, a.chunk)]
        tabs = [blocks(k) for k in lens]
        starts = [0]
        for k in lens:
            starts.append(starts[-1] + k)
        slots = [t[i // bs] * bs + i % bs for t, k in zip(tabs, lens) for i in range(k)]
        meta = AttnMetadata(slot_mapping=torch.tensor(slots, device=dev), block_tables=table(tabs),
                            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
                            num_decode=0, max_query_len=max(lens))
        ids = torch.randint(vocab, (n,), generator=g).to(dev)
        pos = torch.cat([torch.arange(k) for k in lens]).to(dev)
        last = torch.tensor(starts[1:], device=dev) - 1
        return lambda: model(ops, ids, pos, caches, meta, last)

    sizes = [int(x) for x in a.tokens.split(",")]
    ks = [int(x) for x in a.steps.split(",")]
    prefills = {n: prefill_fn(n) for n in sizes}
    with torch.inference_mode():
        for _ in range(3):
            decode()
            for f in prefills.values():
                f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode()
        graph.replay()
        pre_graphs = {}
        for n, f in prefills.items():  # captured too, so that the host's launches do not pace it
            pre_graphs[n] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(pre_graphs[n]):
                f()
            pre_graphs[n].replay()
        torch.cuda.synchronize()

    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    streams = {"high": torch.cuda.Stream(priority=hi), "same": torch.cuda.Stream(priority=0)}
    pre_stream = torch.cuda.Stream(priority=0)
    main_stream = torch.cuda.current_stream()
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    lead_cycles = int(8e-3 * 1.7e9)  # ~8 ms: the host queues the prefill's launches meanwhile

    def once(k: int, n: int | None, dec: torch.cuda.Stream | None) -> tuple[float, float]:
        """-> (ms to the end of the decode part or the prefill if none, ms to the end of all)."""
        start, dec_end, end = ev(), ev(), ev()
        torch.cuda._sleep(lead_cycles)
        start.record()
        if n is not None:
            pre_stream.wait_stream(main_stream)
            with torch.cuda.stream(pre_stream):
                pre_graphs[n].replay()
        if dec is not None:
            dec.wait_stream(main_stream)
            with torch.cuda.stream(dec):
                for _ in range(k):
                    graph.replay()
                dec_end.record()
            main_stream.wait_stream(dec)
        if n is not None:
            main_stream.wait_stream(pre_stream)
        end.record()
        if dec is None:
            dec_end = end
        torch.cuda.synchronize()
        return start.elapsed_time(dec_end), start.elapsed_time(end)

    def median(k: int, n: int | None, dec) -> tuple[float, float]:
        runs = [once(k, n, dec) for _ in range(a.repeats + 2)][2:]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    out = {"gpu": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(), "model": a.model,
           "decodes": D, "context": a.context, "chunk": a.chunk, "priority_range": [lo, hi], "cases": []}
    with torch.inference_mode():
        pre_alone = {n: median(0, n, None)[1] for n in sizes}
        for k in ks:
            dec_alone = median(k, None, streams["high"])[1]
            for n in sizes:
                case = {"tokens": n, "steps": k, "decode_ms": dec_alone, "prefill_ms": pre_alone[n],
                        "sum_ms": dec_alone + pre_alone[n]}
                for name, s in streams.items():
                    d_end, end = median(k, n, s)
                    case[f"{name}_decode_end_ms"], case[f"{name}_end_ms"] = d_end, end
                    case[f"{name}_hidden"] = (case["sum_ms"] - end) / min(dec_alone, pre_alone[n])
                out["cases"].append(case)
                print(json.dumps(case), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


def halves(a, whole, whole_tokens, parts: list, part_tokens: list) -> int:
    """--halves: the whole decode step against its two halves (each a CUDA graph with its own
    buffers) one after the other on one stream and at once on two, medians of --repeats; the
    halves' greedy tokens after each way against the whole step's (halves in turn may differ at
    near-ties, by the plans of smaller kernels)."""
    import torch

    from kernels import launch

    with torch.inference_mode():
        graphs = []
        for f in [whole] + parts:
            # each graph its own arrival counters, from before the function's first run (its attention
            # launches, planned then, keep theirs for every later run)
            launch.separate_arrival_counters(torch.device("cuda", torch.cuda.current_device()))
            for _ in range(3):
                f()
            torch.cuda.synchronize()
            graphs.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(graphs[-1]):
                f()
        torch.cuda.synchronize()
    g_whole, g_parts = graphs[0], graphs[1:]
    side = [torch.cuda.Stream(), torch.cuda.Stream()]
    main = torch.cuda.current_stream()
    reps = 8

    def timed(way: str) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(4e-3 * 1.7e9))  # the host queues everything meanwhile
        start.record()
        if way == "whole":
            for _ in range(reps):
                g_whole.replay()
        elif way == "halves in turn":
            for _ in range(reps):
                for gr in g_parts:
                    gr.replay()
        else:
            for st, gr in zip(side, g_parts):
                st.wait_stream(main)
                with torch.cuda.stream(st):
                    for _ in range(reps):
                        gr.replay()
            for st in side:
                main.wait_stream(st)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    out = {"gpu": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(), "model": a.model,
           "decodes": a.decodes, "context": a.context, "steps_per_replay": 1, "ms_per_step": {}}
    out["tokens_equal"] = {}
    for way in ("whole", "halves in turn", "halves on two streams"):
        runs = [timed(way) for _ in range(a.repeats + 2)][2:]
        out["ms_per_step"][way] = statistics.median(runs)
        line = f"{way:22s} {out['ms_per_step'][way]:.3f} ms a step"
        if way != "whole":
            same = [int((whole_tokens[i::2] == t).sum()) for i, t in enumerate(part_tokens)]
            out["tokens_equal"][way] = f"{sum(same)} of {len(whole_tokens)}"
            line += f"; tokens equal to the whole step's: {out['tokens_equal'][way]}"
        print(line, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
