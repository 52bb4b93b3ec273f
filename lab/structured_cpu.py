"""Structured output and tool calls on the CPU with the real default model (SmolLM2-135M-Instruct),
through the unmodified openai client against a server on this machine: 50 requests with the nested
JSON schema (every output parsed and validated with jsonschema), 20 tool-call requests with
tool_choice="required" (every call's arguments validated against its function's schema), a streamed
tool call against its non-streamed twin, and json_object requests; then the host cost of the grammar
per step (the masks of N rows, and their application to the logits).

    python -m lab.structured_cpu [--out bench/results/structured-output-cpu-DATE.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lab.structured_schemas import NESTED_INSTANCE, NESTED_SCHEMA, TIME_TOOL, WEATHER_TOOL, compact

PEOPLE = ["Marie Curie", "a chef from Lyon", "Ada Lovelace", "a retired teacher", "a street artist", "Alan Turing",
          "a doctor in Nairobi", "a software engineer", "Frida Kahlo", "a marathon runner"]
QUESTIONS = ["What's the weather in {}?", "What time is it in {}?", "Is it raining in {} right now?",
             "How warm is it in {}, in fahrenheit?"]
CITIES = ["Paris", "Tokyo", "London", "Cairo", "Sydney"]
JSON_OBJECT_ASKS = ["Reply in JSON: what is the capital of France?",
                    "Output a JSON object with fields city and country for Paris.",
                    "Return a JSON object with the keys name and year for the book 1984.",
                    "Describe a cat as a JSON object with name, age and color.",
                    "Give a JSON object with the title and author of a famous novel."]


def nested_requests(client: Any, n: int) -> dict[str, Any]:
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED_SCHEMA}}

    def one(i: int) -> tuple[str, str]:
        r = client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} as JSON."}],
            response_format=fmt, max_tokens=300, temperature=0.8, seed=i)
        return r.choices[0].message.content, r.choices[0].finish_reason

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(n)))
    valid = 0
    for text, reason in results:
        try:
            jsonschema.validate(json.loads(text), NESTED_SCHEMA)
            valid += reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": n, "valid": valid, "seconds": round(time.perf_counter() - t0, 1), "example": results[0][0]}


def tool_requests(client: Any, n: int) -> dict[str, Any]:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}

    def one(i: int) -> Any:
        q = QUESTIONS[i % len(QUESTIONS)].format(CITIES[i % len(CITIES)])
        return client.chat.completions.create(model=None, messages=[{"role": "user", "content": q}],
                                              tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                                              max_tokens=150, temperature=0.8, seed=i)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(one, range(n)))
    valid = calls = 0
    for r in responses:
        ok = r.choices[0].finish_reason == "tool_calls" and bool(r.choices[0].message.tool_calls)
        for c in r.choices[0].message.tool_calls or []:
            calls += 1
            try:
                jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
            except (ValueError, KeyError, jsonschema.ValidationError):
                ok = False
        valid += ok
    # streamed against non-streamed (greedy: the same tokens)
    kw = {"model": None, "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
          "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required", "max_tokens": 150, "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0].message
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(d.index, [d.function.name or "", ""])
            entry[1] += d.function.arguments or ""
    same = [tuple(v) for _, v in sorted(streamed.items())] == [(c.function.name, c.function.arguments)
                                                                for c in whole.tool_calls]
    return {"requests": n, "valid": valid, "calls": calls, "seconds": round(time.perf_counter() - t0, 1),
            "stream_equals_message": same, "example": [c.model_dump() for c in responses[0].choices[0].message.tool_calls]}


def json_object_requests(client: Any) -> dict[str, Any]:
    parsed = 0
    reasons = []
    for ask in JSON_OBJECT_ASKS:
        r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": ask}],
                                           response_format={"type": "json_object"}, max_tokens=300, temperature=0)
        reasons.append(r.choices[0].finish_reason)
        try:
            parsed += isinstance(json.loads(r.choices[0].message.content), dict)
        except ValueError:
            pass
    return {"requests": len(JSON_OBJECT_ASKS), "parsed": parsed, "finish_reasons": reasons}


def host_mask_cost(rows: int, engine: Any) -> dict[str, Any]:
    """ms per step for the masks of `rows` sequences walking the nested schema's instance, and for
    applying them to [rows, V] float32 logits, on this CPU."""
    import torch

    from engine.grammar import json_schema_grammar
    from engine.grammar_mask import apply_token_bitmask
    from scheduler.request import SamplingParams, ScheduledSeq, Sequence, SequenceStatus, next_seq_id

    masks = engine.runner.grammar
    grammar = json_schema_grammar(NESTED_SCHEMA)
    tokens = engine.tokenizer.encode(compact(NESTED_INSTANCE), add_special_tokens=False)
    seqs = [Sequence(next_seq_id(), [1, 2], SamplingParams(max_tokens=500, grammar=grammar)) for _ in range(rows)]
    vocab = engine.model_config.vocab_size
    logits = torch.randn(rows, vocab)
    fill_ms, apply_ms = [], []
    for tok in tokens:
        items = [ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs]
        t0 = time.perf_counter()
        bitmask, index = masks.masks(items)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, bitmask, index)
        t2 = time.perf_counter()
        fill_ms.append((t1 - t0) * 1e3)
        apply_ms.append((t2 - t1) * 1e3)
        for s in seqs:
            s.token_ids.append(tok)
    for s in seqs:
        s.status = SequenceStatus.FINISHED
    return {"rows": rows, "steps": len(tokens), "fill_ms_median": round(statistics.median(fill_ms[1:]), 3),
            "apply_ms_median": round(statistics.median(apply_ms[1:]), 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nested", type=int, default=50)
    p.add_argument("--tools", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import openai

    from engine.config import EngineConfig
    from serve.build import build_engine
    from tests.serve.helpers import ServerThread

    engine = build_engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=1024, max_num_seqs=16,
                                       max_model_len=2048), show_progress=False)
    out: dict[str, Any] = {"model": engine.model_name, "device": "cpu", "cpu": platform.processor() or platform.machine(),
                           "date": time.strftime("%Y-%m-%d")}
    with ServerThread(engine) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=900)
        out["nested_schema"] = nested_requests(client, args.nested)
        print("nested schema:", out["nested_schema"], flush=True)
        out["tool_calls_required"] = tool_requests(client, args.tools)
        print("tool calls:", out["tool_calls_required"], flush=True)
        out["json_object"] = json_object_requests(client)
        print("json_object:", out["json_object"], flush=True)
        out["host_mask_cost"] = [srv.call(lambda core, r=r: host_mask_cost(r, engine)) for r in (1, 16, 64)]
        print("host mask cost:", out["host_mask_cost"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
