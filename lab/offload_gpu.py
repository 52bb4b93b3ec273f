"""The host tier of the KV cache (issue 39) on one GPU: a multi-turn workload whose histories exceed
the GPU's cache, served without offload and with --kv-offload-gib, in the same call.

Stages:
- check (a child process): greedy outputs of a small model (--check-model) whose conversation
  histories come back from the host tier, against the same model with a device cache that holds
  everything (the same prefix hits, so the same step shapes: the outputs must agree exactly); and
  the measured pinned host<->device copy bandwidth.
- bench: `serve run` (Llama-3-8B shape, dummy weights, --num-kv-blocks so the device cache holds a
  fraction of the histories) without offload, then with --kv-offload-gib; `serve bench
  --multi-turn` against each; /metrics scraped after each run (hits per tier, bytes moved).

The result (--out): GPU and date, both runs' figures, the median follow-up TTFT ratio (target
<= 1/3), the output throughput ratio (target >= 1), and the bytes moved against the measured
pinned bandwidth.

    python -m lab.offload_gpu --model .models/llama3-8b --check-model .models/qwen2.5-0.5b --out /tmp/offload.json

A CPU smoke run of the plumbing: --server-args "--device cpu" --skip-check with a tiny model and sizes.
"""
from __future__ import annotations

import argparse
import gc
import json
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.server import ManagedServer


def log(msg: str) -> None:
    print(f"== {msg} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)


# --- check: greedy agreement and pinned bandwidth (a child process: its CUDA context goes with it) ----

def pinned_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """GB/s of host->device and device->host copies from page-locked memory (the host tier's kind)."""
    import torch

    from kvcache.host_pool import pin_in_place
    from kvcache.pool import zeros

    host = zeros((nbytes,), torch.uint8, "cpu")
    pin_in_place(host)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_gbs"] = nbytes / sorted(times)[len(times) // 2] / 1e9
    return out


def run_check(args: argparse.Namespace) -> dict:
    import random

    import torch

    from serve import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    from engine.config import ModelConfig

    ctx = min(2048, ModelConfig.from_path(args.check_model).max_context_len)
    common = dict(load_format="dummy", max_num_seqs=8, max_model_len=ctx)
    big = LLM(args.check_model, num_kv_blocks=2048, **common)
    vocab = min(30000, big.engine.model_config.vocab_size)
    rng = random.Random(0)
    # 12 conversations of 3 turns, up to ~ctx/2 tokens each: 24k tokens of histories at ctx 2048
    convs = [[[rng.randrange(10, vocab) for _ in range(rng.randrange(ctx // 20, ctx // 7))] for _ in range(3)]
             for _ in range(12)]

    from tests.engine.test_kv_offload import run_turns

    want = run_turns(big, convs, greedy)
    big_block = big.config.block_size
    big.shutdown()
    del big
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    # a device cache of ~ctx * 3/4 tokens: the histories come back from the host tier
    small = LLM(args.check_model, num_kv_blocks=ctx * 3 // 4 // big_block, kv_offload_gib=1, **common)
    got = run_turns(small, convs, greedy)
    bm, sched = small.engine.core.block_manager, small.engine.core.scheduler
    result = {
        "check_model": args.check_model,
        "check_requests": len(want),
        "check_agree": sum(a == b for a, b in zip(got, want)),
        "check_host_hit_tokens": sched.prefix_cache_host_hits,
        "check_blocks_out": bm.num_blocks_out,
        "check_blocks_in": bm.num_blocks_in,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    small.shutdown()
    del small
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        result.update(pinned_bandwidth())
    return result


# --- bench: serve run without and with the host tier --------------------------------------------

def scrape(port: int) -> dict[str, float]:
    """The /metrics samples, by name with their labels in the key (tier=..., direction=...)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            if "le" in s.labels:
                continue
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def serve_and_bench(args: argparse.Namespace, label: str, extra: list[str], out_dir: Path) -> dict:
    server = ManagedServer([sys.executable, "-m", "serve", "run"], args.model, load_format="dummy",
                           extra_args=["--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
                                       str(args.max_model_len), *shlex.split(args.server_args), *extra],
                           startup_timeout_s=args.server_timeout, log_path=out_dir / f"{label}-server.log")
    log(f"{label}: {shlex.join(server.argv())}")
    t0 = time.perf_counter()
    with server:
        started_s = time.perf_counter() - t0
        log(f"{label}: up in {started_s:.0f} s")
        result_json = out_dir / f"{label}.json"
        bench = [sys.executable, "-m", "serve", "bench", "--url", server.base_url, "--model", args.model,
                 "--multi-turn", str(args.turns), "--num-prompts", str(args.conversations),
                 "--input-len", str(args.first_len), "--turn-len", str(args.turn_len),
                 "--output-len", str(args.output_len), "--concurrency", str(args.concurrency), "--ignore-eos",
                 "--copy-bandwidth", "1", "--matmul-tflops", "1",  # no roofline for multi-turn: skip measuring it
                 "--result-json", str(result_json)]
        done = subprocess.run(bench, capture_output=True, text=True, timeout=args.bench_timeout)
        print(done.stdout[-3000:], file=sys.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"{label}: serve bench failed ({done.returncode}): {done.stderr[-500:]}")
        metrics = scrape(server.port)
    res = json.loads(result_json.read_text())
    keys = ("completed", "failed", "duration_s", "output_throughput", "total_token_throughput",
            "median_first_turn_ttft_ms", "p99_first_turn_ttft_ms", "median_follow_up_ttft_ms",
            "p99_follow_up_ttft_ms", "mean_first_turn_prompt_tokens", "mean_follow_up_prompt_tokens",
            "median_tpot_ms")
    p = "pagedserve:"
    return {
        "server_args": shlex.join(server.argv()[3:]), "startup_s": round(started_s, 1), **{k: res.get(k) for k in keys},
        "prefix_cache_queries": metrics.get(p + "prefix_cache_queries_total"),
        "prefix_cache_hits": metrics.get(p + "prefix_cache_hits_total"),
        "device_hit_tokens": metrics.get(p + "prefix_cache_tier_hits_total{tier=device}"),
        "host_hit_tokens": metrics.get(p + "prefix_cache_tier_hits_total{tier=host}"),
        "bytes_out": metrics.get(p + "kv_offload_bytes_total{direction=out}"),
        "bytes_in": metrics.get(p + "kv_offload_bytes_total{direction=in}"),
        "host_blocks_used": metrics.get(p + "host_kv_cache_used_blocks"),
        "host_blocks_total": metrics.get(p + "host_kv_cache_total_blocks"),
        "preemptions": metrics.get(p + "num_preemptions_total"),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/llama3-8b")
    p.add_argument("--check-model", default=".models/qwen2.5-0.5b")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--offload-gib", type=float, default=64.0)
    # 16,384 blocks of 16 = 262k tokens: the running turns (32 x ~3.3k) and ~150k tokens of cache,
    # against ~640k tokens of histories at the end (200 x 3.2k)
    p.add_argument("--num-kv-blocks", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=1024)
    p.add_argument("--turn-len", type=int, default=640)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--server-args", default="", help="more `serve run` flags for both servers")
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--bench-timeout", type=float, default=400.0)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--stage", choices=("all", "check"), default="all", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage == "check":
        Path(args.out).write_text(json.dumps(run_check(args)))
        return 0
    t0 = time.perf_counter()
    out_dir = Path(tempfile.mkdtemp(prefix="offload_gpu_"))
    result: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "workload": {k: getattr(args, k) for k in ("conversations", "turns", "first_len", "turn_len",
                                                               "output_len", "concurrency", "num_kv_blocks",
                                                               "offload_gib")},
                    "model": args.model}
    if not args.skip_check:
        log("check: greedy agreement through the host tier, pinned bandwidth")
        check_out = out_dir / "check.json"
        subprocess.run([sys.executable, "-m", "lab.offload_gpu", "--stage", "check", "--check-model", args.check_model,
                        "--out", str(check_out)], check=True, timeout=300)
        result.update(json.loads(check_out.read_text()))
        log(f"check: {result['check_agree']}/{result['check_requests']} agree, {result['check_host_hit_tokens']} "
            f"host-hit tokens; pinned h2d {result.get('h2d_gbs', 0):.1f} GB/s d2h {result.get('d2h_gbs', 0):.1f} GB/s")
    runs = {}
    runs["no_offload"] = serve_and_bench(args, "no_offload", [], out_dir)
    runs["offload"] = serve_and_bench(args, "offload", ["--kv-offload-gib", str(args.offload_gib)], out_dir)
    result["runs"] = runs
    off, base = runs["offload"], runs["no_offload"]
    result["follow_up_ttft_ratio"] = ratio(off["median_follow_up_ttft_ms"], base["median_follow_up_ttft_ms"])
    result["p99_follow_up_ttft_ratio"] = ratio(off["p99_follow_up_ttft_ms"], base["p99_follow_up_ttft_ms"])
    result["throughput_ratio"] = ratio(off["output_throughput"], base["output_throughput"])
    moved = (off["bytes_out"] or 0) + (off["bytes_in"] or 0)
    result["bytes_moved"] = moved
    bw = result.get("h2d_gbs")
    if bw:
        # the copies' time at the measured pinned bandwidth, and its share of the offload run
        copy_s = (off["bytes_in"] or 0) / (bw * 1e9) + (off["bytes_out"] or 0) / (result["d2h_gbs"] * 1e9)
        result["copy_s_at_pinned_bandwidth"] = copy_s
        result["copy_share_of_run"] = ratio(copy_s, off["duration_s"])
        result["mean_moved_gbs_over_run"] = moved / 1e9 / off["duration_s"] if off["duration_s"] else None
    result["targets_met"] = {
        "follow_up_ttft_ratio<=1/3": result["follow_up_ttft_ratio"] is not None and result["follow_up_ttft_ratio"] <= 1 / 3,
        "throughput_ratio>=1": result["throughput_ratio"] is not None and result["throughput_ratio"] >= 1.0,
    }
    if "gpu" not in result:
        try:
            import torch
            result["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        except ImportError:
            result["gpu"] = None
    result["total_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("gpu", "follow_up_ttft_ratio", "throughput_ratio", "bytes_moved",
                                             "targets_met", "total_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
