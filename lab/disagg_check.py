"""Disaggregated prefill/decode on GPUs against one GPU: greedy completions of `serve run
--disaggregate 1:1` (prefill on GPU 0, decode on GPU 1, which copies the KV from GPU 0) and of
`serve run` on GPU 0, the same dummy-weight model, one request at a time (the same batch shapes on
both), streamed.

    python -m lab.disagg_check --model qwen2.5-0.5b --out disagg_check.json

Both servers run at once (GPU 0 is shared: one takes --gpu-memory-utilization of it, the other as
much again). The report says how many completions match exactly and where the others first
differ, and the server's KV-transfer counters.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

from bench.server import free_port, wait_healthy


def start(model: str, extra: list[str], env: dict, log: Path, util: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "serve.cli", "run", "--model", model, "--load-format", "dummy", "--port", str(port),
           "--gpu-memory-utilization", str(util), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def complete(url: str, prompt: list[int], max_tokens: int) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["text"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--max-token-id", type=int, default=20000, help="prompts are random ids below it")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, a.max_token_id) for _ in range(rng.randrange(16, 700))] for _ in range(a.prompts)]
    logs = Path(a.out.parent if a.out else ".")
    # one after the other, the second with twice the share: an engine counts what another process
    # holds on its GPU as taken from its own budget
    one, one_url = start(a.model, [], {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}, logs / "one-gpu.log",
                         a.gpu_memory_utilization)
    pd = None
    try:
        wait_healthy(one, one_url, 600)
        pd, pd_url = start(a.model, ["--disaggregate", "1:1"], {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"},
                           logs / "disagg.log", min(1.0, 2 * a.gpu_memory_utilization))
        wait_healthy(pd, pd_url, 600)
        rows = []
        for prompt in prompts:
            want, got = complete(one_url, prompt, a.max_tokens), complete(pd_url, prompt, a.max_tokens)
            w, g = want.split(), got.split()
            first = next((i for i, (x, y) in enumerate(zip(w, g)) if x != y),
                         None if len(w) == len(g) else min(len(w), len(g)))
            rows.append({"prompt_len": len(prompt), "match": want == got, "first_difference": first})
        with urllib.request.urlopen(f"{pd_url}/metrics") as r:
            metrics = [line for line in r.read().decode().splitlines()
                       if line.startswith(("pagedserve:kv_transfer", "pagedserve:engine_up"))
                       and "_bucket" not in line]
    finally:
        for proc in (one, pd):
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    report = {"model": a.model, "matches": sum(r["match"] for r in rows), "of": len(rows), "rows": rows,
              "metrics": metrics}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    for r in rows:
        if not r["match"]:
            print(f"prompt of {r['prompt_len']} tokens: first difference at output token {r['first_difference']}")
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
