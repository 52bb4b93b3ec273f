"""Start-up time of `serve run`: from the command to the first answer of GET /health, with a cold
Triton cache (an empty TRITON_CACHE_DIR: what a fresh machine compiles) and a warm one (the same
directory again), the engine's own phases (the "engine started in" log line), and a timeline: when
each start-up mark arrived (the server runs with --log-level debug for its "start-up:" marks).

    python -m lab.startup --model llama3-8b --model qwen2.5-0.5b --out startup.json [--server-args "..."]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

PHASES = re.compile(r"engine started in ([\d.]+) s \((.*)\)")
# the lines worth a time stamp: start-up's own debug marks, the engine's phases, the server's start
TIMELINE = re.compile(r"start-up:|step cost model|captured|engine started|pagedserve: model|Application startup|Uvicorn running")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_start(model: str, triton_cache: Path, server_args: list[str], timeout_s: float) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "serve", "run", "--model", model, "--load-format", "dummy", "--port", str(port),
           "--log-level", "debug", *server_args]
    # cold and warm: the Triton cache and the cost model's (engine/cost_cache.py) start empty, then are found
    env = dict(os.environ, TRITON_CACHE_DIR=str(triton_cache), PAGEDSERVE_CACHE=f"{triton_cache}.pagedserve",
               PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[tuple[float, str]] = []  # (seconds since the command, line): the start-up's timeline
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter() - t0, line.rstrip("\n"))
                                                          for line in proc.stdout), daemon=True)
    reader.start()
    ready = None
    while time.perf_counter() - t0 < timeout_s and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    ready = time.perf_counter() - t0
                    break
        except OSError:
            time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    reader.join(10)
    text = "\n".join(line for _, line in lines)
    m = PHASES.search(text)
    phases = {}
    if m:
        for part in m.group(2).split(", "):
            name, value = part.rsplit(" ", 2)[0], float(part.rsplit(" ", 2)[1])
            phases[name] = value
    notes = [line for line in text.splitlines() if "step cost model" in line or "captured" in line]
    timeline = [[round(t, 2), line[:160]] for t, line in lines if (ready is None or t <= ready) and TIMELINE.search(line)]
    return {"ready_s": ready, "engine_s": float(m.group(1)) if m else None, "phases_s": phases, "notes": notes,
            "timeline": timeline, "exit_code": proc.returncode, "log_tail": text[-1500:] if ready is None else ""}


def compiled_kernels(cache: Path) -> dict:
    """What a cold start compiled: per kernel name, the variants and the seconds between the first
    and the last of their cache entries' writes (compiles run one after another)."""
    entries = []
    for meta in cache.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        entries.append((meta.stat().st_mtime, meta.stem))
    entries.sort()
    kernels: dict[str, dict] = {}
    for i, (t, name) in enumerate(entries):
        k = kernels.setdefault(name, {"variants": 0, "seconds": 0.0})
        k["variants"] += 1
        if i:  # the time since the previous write: this compile's duration, when compiles ran back to back
            k["seconds"] += min(t - entries[i - 1][0], 30.0)
    return {"total": len(entries), "span_s": entries[-1][0] - entries[0][0] if entries else 0.0,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["seconds"]))}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m lab.startup")
    p.add_argument("--model", action="append", required=True, help="a preset or config folder (dummy weights)")
    p.add_argument("--server-args", default="", help="extra `serve run` flags")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=None)
    p.add_argument("--cold-only", action="store_true", help="skip the warm start")
    args = p.parse_args()
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model:
            cache = Path(tmp) / model  # empty: cold; the second start finds what the first compiled
            for kind in ("cold",) if args.cold_only else ("cold", "warm"):
                r = time_start(model, cache, shlex.split(args.server_args), args.timeout)
                r.update(model=model, cache=kind)
                if kind == "cold":
                    r["compiled"] = compiled_kernels(cache)
                runs.append(r)
                print(f"{model} {kind}: ready in {r['ready_s']} s; engine {r['engine_s']} s {r['phases_s']}",
                      flush=True)
    out = {"gpu": gpu, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "server_args": args.server_args,
           "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
