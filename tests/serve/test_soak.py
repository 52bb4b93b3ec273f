"""Soak: concurrent clients mixing streaming, non-streaming and cancellation for a while.

PAGEDSERVE_SOAK_SECONDS (default 3) and PAGEDSERVE_SOAK_CONCURRENCY (default 64) set the length
and the load. PAGEDSERVE_SOAK_MODEL (a folder or a preset name such as qwen2.5-0.5b, served with
dummy weights when it has none) and PAGEDSERVE_SOAK_DEVICE (e.g. cuda) run it on a real-size model.
Afterwards: no failures, no leaked blocks, streams or sequences, and memory that did not grow.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.serve.helpers import ServerThread, build

SECONDS = float(os.environ.get("PAGEDSERVE_SOAK_SECONDS", "3"))
CONCURRENCY = int(os.environ.get("PAGEDSERVE_SOAK_CONCURRENCY", "64"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def worker(c: httpx.AsyncClient, wid: int, deadline: float, outcomes: Counter, rss: list,
                 vocab: int, chat_ok: bool) -> None:
    rng = random.Random(wid)
    while time.monotonic() < deadline:
        if wid == 0:
            rss.append((time.monotonic(), rss_mib()))
        kind = rng.choice(["stream", "stream", "whole", "whole", "cancel", "chat" if chat_ok else "whole"])
        max_tokens = rng.randint(1, 48)
        common = {"max_tokens": max_tokens, "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 9),
                  "ignore_eos": rng.random() < 0.7}
        if kind == "chat":
            body = {**common, "messages": [{"role": "user", "content": f"worker {wid} asks {rng.random()}"}],
                    "stream": rng.random() < 0.5, "stream_options": {"include_usage": True}}
            path = "/v1/chat/completions"
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 64))]
            body = {**common, "prompt": prompt, "stream": kind != "whole",
                    "stream_options": {"include_usage": True}}
            path = "/v1/completions"
        if not body["stream"]:
            del body["stream_options"]  # a 400 without stream: true, as with OpenAI and vLLM
        try:
            if not body["stream"]:
                r = await c.post(path, json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= max_tokens
                outcomes["ok" if ok else f"bad {r.status_code} {r.text[:200]}"] += 1
                continue
            async with c.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    outcomes[f"bad {r.status_code}"] += 1
                    continue
                drop_at = rng.randint(0, 10) if kind == "cancel" else None
                lines, done = 0, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                        break
                    if line.startswith("data:"):
                        if '"error"' in line:
                            break
                        lines += 1
                        if drop_at is not None and lines > drop_at:
                            break
                if drop_at is not None and not done:
                    outcomes["cancelled"] += 1
                else:
                    outcomes["ok" if done else "cut"] += 1
        except httpx.HTTPError as e:
            outcomes[f"error {type(e).__name__}"] += 1


def soak_engine(model_dir: Path):
    overrides: dict = dict(max_num_seqs=CONCURRENCY, num_kv_blocks=256)
    if "PAGEDSERVE_SOAK_DEVICE" in os.environ:
        overrides.update(device=os.environ["PAGEDSERVE_SOAK_DEVICE"], dtype="auto")
    if "PAGEDSERVE_SOAK_MODEL" in os.environ:
        from bench.presets import resolve_model

        model_dir = resolve_model(os.environ["PAGEDSERVE_SOAK_MODEL"])
        has_weights = any(model_dir.glob("*.safetensors"))
        overrides.update(num_kv_blocks=None, max_num_batched_tokens=8192, load_format="auto" if has_weights else "dummy")
    return build(model_dir, **overrides)


def test_soak(model_dir):
    engine = soak_engine(model_dir)
    vocab = min(engine.model_config.vocab_size, 30000)
    chat_ok = bool(getattr(engine.tokenizer, "chat_template", None))
    with ServerThread(engine) as srv:
        outcomes: Counter = Counter()
        rss: list[tuple[float, float]] = []

        async def main() -> None:
            limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120, limits=limits) as c:
                deadline = time.monotonic() + SECONDS
                await asyncio.gather(*(worker(c, i, deadline, outcomes, rss, vocab, chat_ok)
                                     for i in range(CONCURRENCY)))

        asyncio.run(main())
        failures = {k: v for k, v in outcomes.items() if k not in ("ok", "cancelled")}
        m = srv.metrics()
        print(f"soak {SECONDS:.0f}s x {CONCURRENCY} on {engine.runner.device}: {dict(outcomes)}; "
              f"{m['pagedserve:generation_tokens_total']:.0f} tokens generated; "
              f"RSS MiB {rss[0][1]:.0f} -> {rss[len(rss) // 2][1]:.0f} -> {rss[-1][1]:.0f}")
        assert not failures, failures
        assert outcomes["ok"] > 0 and outcomes["cancelled"] > 0
        srv.wait_idle()
        loop = srv.state.loop
        assert not loop._streams and not loop._records
        assert srv.call(lambda core: (len(core.scheduler.seqs), len(core.detok))) == (0, 0)
        if len(rss) > 10 and SECONDS >= 60:  # steady memory: the second half grows no more than noise
            mid = rss[len(rss) // 2][1]
            assert rss[-1][1] - mid < 64, rss
