"""What a user sees on a CPU with the default model (README, "What to expect"):
`python -m lab.cpu_expect --out F`.

Starts `serve run` with no arguments (SmolLM2-135M-Instruct, converted once into the cache), and
measures: the time from the command to the first answer (a one-token completion); one streamed
greedy request of a ~128-token prompt and 128 tokens (time to the first token, then tokens a
second); 16 requests 8 at a time through `serve bench` (128 prompt tokens, 64 out, ignore_eos);
the server's and the engine's resident memory; how long Ctrl-C takes to end the server. Then
transformers' `generate` of the same model on the same prompt, greedy, one request. Writes one
JSON with the host and the date; run it on a quiet machine (other jobs move every figure).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from bench.server import free_port

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 8


def _post(url: str, body: dict, timeout: float = 600.0):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return [int(x) for x in out.split()]


def _first_answer(base: str, start: float, proc: subprocess.Popen, timeout_s: float) -> float:
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}")
        try:
            with _post(f"{base}/v1/completions", {"prompt": "Hello", "max_tokens": 1}, timeout=60) as r:
                json.load(r)
            return time.monotonic() - start
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"no answer within {timeout_s:.0f} s")


def _streamed(base: str, max_tokens: int) -> dict:
    t0 = time.monotonic()
    times = []
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    with _post(f"{base}/v1/completions", body) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.monotonic())
    # ignore_eos: exactly max_tokens tokens, in fewer chunks where the text of a token waits for the next
    first = times[0] - t0
    rest = (max_tokens - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return {"tokens": max_tokens, "chunks": len(times), "ttft_s": round(first, 3),
            "tokens_per_s_after_first": round(rest, 2) if rest else None,
            "tokens_per_s_whole": round(max_tokens / (times[-1] - t0), 2)}


def _bench(base: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "serve.cli", "bench", "--url", base, "--concurrency", "8", "--num-prompts", "16",
           "--input-len", "128", "--output-len", "64", "--ignore-eos", "--result-json", str(out)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1200)
    res = json.loads(out.read_text())
    return {k: res[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "completed", "failed")}


def _hf_generate(max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.default_model import default_model_path

    path = default_model_path(quiet=True)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.monotonic()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        s = time.monotonic() - t0
    n = out.shape[1] - ids.shape[1]
    return {"prompt_tokens": ids.shape[1], "tokens": n, "seconds": round(s, 2), "tokens_per_s": round(n / s, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.cpu_expect", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the first answer")
    a = p.parse_args(argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    result: dict = {"host": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    log = tempfile.NamedTemporaryFile(prefix="cpu-expect-server-", suffix=".log", delete=False)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "run", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        result["first_answer_s"] = round(_first_answer(base, start, proc, a.timeout), 2)
        result["rss_after_start_mib"] = {"server": round(_rss_mib(proc.pid)),
                                         "children": [round(_rss_mib(c)) for c in _children(proc.pid)]}
        result["one_request_128"] = _streamed(base, 128)
        with tempfile.TemporaryDirectory() as d:
            result["bench_8_of_16"] = _bench(base, Path(d) / "bench.json")
        result["rss_after_requests_mib"] = {"server": round(_rss_mib(proc.pid)),
                                            "children": [round(_rss_mib(c)) for c in _children(proc.pid)]}
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        result["exit_code"] = proc.wait(timeout=60)
        result["ctrl_c_s"] = round(time.monotonic() - t0, 2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result["transformers_generate_128"] = _hf_generate(128)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
