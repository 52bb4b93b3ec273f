"""Why text prompts served fewer tokens/s than token ids (`serve bench --prompt-format text`), on the CPU.

    python -m lab.text_prompts check [--model DIR]       which encode path and how many tokenizing threads
                                                         a server of this folder takes here
    python -m lab.text_prompts lengths [--model DIR]     the server's token counts of the bench's text prompts
    python -m lab.text_prompts encode [--model DIR]      planning a 512-token request: text vs ids, and
                                                         the GIL a tokenizing thread holds, by encode path
    python -m lab.text_prompts busy [--model DIR]        bursts of text requests planned beside an event loop kept
                                                         busy: on threads (by switch interval), on the loop, and
                                                         through the server's tokenizing processes
    python -m lab.text_prompts steps RESULT.json ...     `serve bench --result-json` files: the steps that
                                                         carried prompts, from each request's first token
    python -m lab.text_prompts probe --model DIR --out DIR   (GPU) one server, `serve bench --url` with ids,
                                                         text, ids, text prompts; the server's own TTFT from
                                                         /metrics around each run beside the client's

`steps` reads what the client saw: requests whose first tokens came within 0.5 ms of each other were
prefilled in one step. With multi-step scheduling (scheduler/policy.py) every such step ends a round of
decode steps, so the fewer prompts a prompt step carries, the more steps pay the host's work alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

DEFAULT_MODEL = ".models/qwen2.5-0.5b"  # the GPU runs' folder: a Qwen config with the SmolLM2 tokenizer
STEP_GAP_S = 0.0005


def _tokenizer(model: str) -> Any:
    from serve.build import load_tokenizer

    return load_tokenizer(Path(model))


def _text_requests(tok: Any, n: int, input_len: int = 512, vocab: int = 49152, seed: int = 0) -> list[Any]:
    from bench.workload import WorkloadSpec, as_text, make_requests

    return as_text(make_requests(WorkloadSpec(num_prompts=n, input_len=input_len, output_len=128,
                                              vocab_size=vocab, seed=seed)), tok)


def check(args: argparse.Namespace) -> None:
    import os

    import tokenizers
    import transformers

    from serve.prompts import ENCODE_PATH, RequestPlanner
    from serve.server_config import ServerConfig
    from serve.tokenize_pool import pool_size

    tok = _tokenizer(args.model)
    planner = RequestPlanner(tok, len(tok), 32768, ServerConfig())
    print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, {type(tok).__name__}, "
          f"{os.cpu_count()} CPUs: encodes through "
          f"{'the Rust tokenizer (encode_batch_fast)' if planner.rust_encode else 'tokenizer.encode'}, "
          f"{pool_size() if planner.rust_encode else 0} tokenizing process(es)")
    if planner.rust_encode is None:
        backend = getattr(tok, "backend_tokenizer", None)
        print(f"  truncation {getattr(backend, 'truncation', None)}, padding {getattr(backend, 'padding', None)}, "
              f"split_special_tokens {getattr(tok, 'split_special_tokens', None)} / "
              f"{getattr(backend, 'encode_special_tokens', None)}")
        for name in ENCODE_PATH:
            method = getattr(type(tok), name, None)
            print(f"  {name}: {getattr(method, '__module__', None)}")


def lengths(args: argparse.Namespace) -> None:
    from bench.workload import WorkloadSpec, as_text, make_requests

    tok = _tokenizer(args.model)
    for input_len, ratio in ((512, 0.0), (16, 0.0), (100, 0.5), (2048, 0.0)):
        spec = WorkloadSpec(num_prompts=args.n, input_len=input_len, output_len=128, range_ratio=ratio,
                            vocab_size=len(tok))
        ids = make_requests(spec)
        start = time.perf_counter()
        texts = as_text(ids, tok)
        took = time.perf_counter() - start
        server = [len(tok.encode(r.prompt, add_special_tokens=True)) for r in texts]
        off = [s - len(r.prompt) for s, r in zip(server, ids)]
        claimed = sum(s != r.prompt_tokens for s, r in zip(server, texts))
        print(f"input {input_len} (+-{ratio:.0%}): server count - intended: min {min(off)}, max {max(off)}, "
              f"{sum(o != 0 for o in off)} of {len(off)} off; prompt_tokens != server count: {claimed}; "
              f"{statistics.mean(len(r.prompt) for r in texts):.0f} characters; as_text {took:.2f} s")


def _best_us(fn: Callable[[Any], Any], items: list[Any], reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for x in items:
            fn(x)
        best = min(best, (time.perf_counter() - start) / len(items))
    return best * 1e6


def _gil_held_share(fn: Callable[[str], Any], texts: list[str], seconds: float = 2.0) -> tuple[float, float]:
    """(the share of its time a pure-Python thread lost while another called fn in a loop, calls/s).
    Near 0: fn lets go of the GIL while it works; near 0.5: it holds the GIL throughout."""
    def spin(until: float) -> int:
        n = 0
        while time.perf_counter() < until:
            n += 1
        return n

    alone = spin(time.perf_counter() + seconds)
    stop, calls = threading.Event(), [0]

    def work() -> None:
        while not stop.is_set():
            for t in texts:
                fn(t)
                calls[0] += 1
                if stop.is_set():
                    break

    th = threading.Thread(target=work)
    th.start()
    beside = spin(time.perf_counter() + seconds)
    stop.set()
    th.join()
    return 1.0 - beside / alone, calls[0] / seconds


def encode(args: argparse.Namespace) -> None:
    from bench.client import CompletionTarget
    from bench.workload import BenchRequest
    from serve.prompts import RequestPlanner
    from serve.protocol import CompletionRequest
    from serve.server_config import ServerConfig

    tok = _tokenizer(args.model)
    texts = _text_requests(tok, args.n)
    ids = [BenchRequest(r.index, tok.encode(r.prompt), r.output_len) for r in texts]
    target = CompletionTarget(url="", model="m", ignore_eos=True)
    bodies = {k: [json.dumps(target.payload(r)).encode() for r in reqs] for k, reqs in (("ids", ids), ("text", texts))}
    wrapped = RequestPlanner(tok, len(tok), 32768, ServerConfig())
    wrapped.rust_encode = None  # what the planner did before: tokenizer.encode
    planner = RequestPlanner(tok, len(tok), 32768, ServerConfig())
    print(f"request body: ids {statistics.mean(map(len, bodies['ids'])):.0f} bytes, "
          f"text {statistics.mean(map(len, bodies['text'])):.0f} bytes")
    for kind in ("ids", "text"):
        raw = bodies[kind]
        parse_us = _best_us(lambda b: CompletionRequest.model_validate(json.loads(b)), raw)
        print(f"{kind:5s} JSON + pydantic          {parse_us:8.1f} us")
        reqs = [CompletionRequest.model_validate(json.loads(b)) for b in raw]
        for label, p in (("tokenizer.encode", wrapped), ("Rust encode_batch_fast", planner)):
            if kind == "ids" and p is planner:
                continue
            print(f"{kind:5s} planner.completion ({label}) {_best_us(p.completion, reqs):8.1f} us")
    strs = [r.prompt for r in texts]
    backend = tok.backend_tokenizer
    paths: list[tuple[str, Callable[[str], Any]]] = [
        ("tokenizer.encode (transformers)", lambda s: tok.encode(s)),
        ("Tokenizer.encode (Rust)", lambda s: backend.encode(s).ids),
        ("Tokenizer.encode_batch (Rust)", lambda s: backend.encode_batch([s])[0].ids),
        ("Tokenizer.encode_batch_fast (Rust)", lambda s: backend.encode_batch_fast([s])[0].ids),
    ]
    for label, fn in paths:
        lost, rate = _gil_held_share(fn, strs)
        print(f"{label:36s} {_best_us(fn, strs):7.0f} us a 512-token prompt; beside it a Python thread lost "
              f"{lost:4.0%} of its time ({rate:.0f} encodes/s)")


def busy(args: argparse.Namespace) -> None:
    """Bursts of k text requests planned while the event loop runs 40 us Python tasks back to back
    (a server streaming under load): the median and last request's wait, and the loop's own work
    done meanwhile, for threads at several GIL switch intervals, the loop itself, and the pool."""
    import asyncio

    from serve.prompts import RequestPlanner
    from serve.protocol import CompletionRequest
    from serve.server_config import ServerConfig
    from serve.tokenize_pool import TokenizePool

    tok = _tokenizer(args.model)
    reqs = [CompletionRequest.model_validate({"prompt": r.prompt, "max_tokens": 128}) for r in _text_requests(tok, 64)]
    planner = RequestPlanner(tok, len(tok), 32768, ServerConfig())
    k = 13

    def work(us: float) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    async def loop_busy(stop: asyncio.Event, count: list[int]) -> None:
        while not stop.is_set():
            work(40)
            count[0] += 1
            await asyncio.sleep(0)

    async def run(mode: str) -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        threads = ThreadPoolExecutor(args.threads)
        pool = TokenizePool.for_tokenizer(tok) if mode == "pool" else None
        if pool is not None:
            await pool.start()
            await pool.encode(["warm"], True)
        stop, count = asyncio.Event(), [0]
        task = asyncio.create_task(loop_busy(stop, count))
        waits, lasts, t0 = [], [], time.perf_counter()
        for rep in range(args.reps):
            start = time.perf_counter()

            async def one(r: CompletionRequest) -> float:
                if mode == "loop":
                    planner.completion(r)
                elif mode == "pool":
                    d = planner.completion_draft(r)
                    d.finish(await pool.encode(d.texts, d.add_special_tokens))
                else:
                    await loop.run_in_executor(threads, planner.completion, r)
                return time.perf_counter() - start
            got = await asyncio.gather(*[one(reqs[(rep * k + i) % len(reqs)]) for i in range(k)])
            waits += got
            lasts.append(max(got))
            await asyncio.sleep(0.02)
        rate = count[0] / (time.perf_counter() - t0)
        stop.set()
        await task
        threads.shutdown()
        if pool is not None:
            pool.close()
        return statistics.median(waits) * 1e3, statistics.median(lasts) * 1e3, rate

    default = sys.getswitchinterval()
    setups = [(f"{args.threads} threads, switch interval {si * 1e3:g} ms", "threads", si) for si in (0.005, 0.001, 0.0002)]
    setups += [("on the loop", "loop", default), ("tokenizing processes", "pool", default)]
    for label, mode, si in setups:
        sys.setswitchinterval(si)
        med, last, rate = asyncio.run(run(mode))
        print(f"{label:40s} burst of {k}: median wait {med:6.1f} ms, last {last:6.1f} ms; loop tasks {rate:,.0f}/s")
    sys.setswitchinterval(default)


def probe(args: argparse.Namespace) -> None:
    import subprocess
    import urllib.request

    from bench.server import ManagedServer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def ttft(base: str) -> tuple[float, float]:
        total = count = 0.0
        for line in urllib.request.urlopen(base + "/metrics").read().decode().splitlines():
            if line.startswith("pagedserve:time_to_first_token_seconds_sum"):
                total += float(line.split()[-1])
            elif line.startswith("pagedserve:time_to_first_token_seconds_count"):
                count += float(line.split()[-1])
        return total, count

    with ManagedServer([sys.executable, "-m", "serve.cli", "run"], args.model, load_format="dummy",
                       log_path=out_dir / "probe-server.out") as server:
        base = server.base_url
        rows = []
        for i, fmt in enumerate(("ids", "text", "ids", "text")):
            label = f"probe-{fmt}-{i}"
            s0, c0 = ttft(base)
            subprocess.run([sys.executable, "-m", "serve.cli", "bench", "--url", base, "--model", args.model,
                            "--concurrency", "64", "--num-prompts", str(args.n), "--input-len", "512", "--output-len", "128",
                            "--ignore-eos", "--num-warmups", "64", "--prompt-format", fmt,
                            "--result-json", str(out_dir / f"{label}.json")],
                           stdout=open(out_dir / f"{label}.out", "w"), stderr=subprocess.STDOUT, timeout=300)
            s1, c1 = ttft(base)
            res = json.loads((out_dir / f"{label}.json").read_text())
            row = {"run": label, "tok_s": round(res["output_throughput"]), "client_median_ttft_ms": round(res["median_ttft_ms"], 1),
                   "client_mean_ttft_ms": round(res["mean_ttft_ms"], 1),
                   "server_mean_ttft_ms": round((s1 - s0) / max(c1 - c0, 1) * 1e3, 1), "median_tpot_ms": round(res["median_tpot_ms"], 3)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        (out_dir / "probe.json").write_text(json.dumps(rows, indent=1))


def prompt_steps(path: str) -> dict[str, Any]:
    """Steps that carried prompts, counted from one `serve bench --result-json` file."""
    res = json.loads(Path(path).read_text())
    rows = [r for r in res["requests"] if r.get("ttft_ms") is not None]
    firsts = sorted(r["start_s"] + r["ttft_ms"] / 1e3 for r in rows)
    steps = 1 + sum(b - a > STEP_GAP_S for a, b in zip(firsts, firsts[1:]))
    prompt_tokens = [r["prompt_tokens"] for r in res["requests"]]
    return {"file": path, "prompt_format": res.get("prompt_format"), "output_throughput": res["output_throughput"],
            "median_tpot_ms": res.get("median_tpot_ms"), "prompt_steps": steps,
            "prompts_per_step": len(firsts) / steps,
            "prompt_tokens": (min(prompt_tokens), statistics.mean(prompt_tokens), max(prompt_tokens))}


def steps(args: argparse.Namespace) -> None:
    rows = [prompt_steps(p) for p in args.results]
    for r in rows:
        lo, mean, hi = r["prompt_tokens"]
        print(f"{r['file']}: {r['prompt_format']}, {r['output_throughput']:,.0f} tok/s, median TPOT "
              f"{r['median_tpot_ms']:.3f} ms; {r['prompt_steps']} prompt steps, {r['prompts_per_step']:.2f} "
              f"prompts each; server-counted prompt tokens {lo}..{hi} (mean {mean:.1f})")
    if len(rows) == 2:
        ratio = rows[1]["output_throughput"] / rows[0]["output_throughput"]
        print(f"{rows[1]['file']} / {rows[0]['file']}: {ratio:.1%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.text_prompts", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("check", "lengths", "encode", "busy"):
        s = sub.add_parser(name)
        s.add_argument("--model", default=DEFAULT_MODEL)
        s.add_argument("--n", type=int, default=200)
        s.add_argument("--reps", type=int, default=20)
        s.add_argument("--threads", type=int, default=8)
    s = sub.add_parser("steps")
    s.add_argument("results", nargs="+")
    s = sub.add_parser("probe")
    s.add_argument("--model", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--n", type=int, default=640)
    args = p.parse_args(argv)
    {"check": check, "lengths": lengths, "encode": encode, "busy": busy, "steps": steps, "probe": probe}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
