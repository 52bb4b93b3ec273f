"""xgrammar against llguidance on our structured-output workloads, on the CPU, with the default
model's tokenizer: grammar compile time and per-token mask time (what the engine's host pays per
constrained row and step).

    python -m lab.grammar_engines [--model DIR] [--repeats 5] [--out results.json]

Each workload is compiled from scratch (a new compiler, no cache) `repeats` times; the mask time is
one matcher walking a valid output token by token: fill the next-token bitmask, then accept the
token (the engine's work per row and step), timed over the whole output and divided by its tokens.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lab.structured_schemas import NESTED_INSTANCE, NESTED_SCHEMA, TIME_TOOL, TOOL_CALL_INSTANCE, WEATHER_TOOL, compact


def tool_call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                         "arguments": t["function"]["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def workloads() -> dict[str, tuple[str, Any, str]]:
    """name -> (kind, grammar source, a valid output)."""
    tools = tool_call_schema([WEATHER_TOOL, TIME_TOOL])
    return {
        "nested_schema": ("json_schema", NESTED_SCHEMA, compact(NESTED_INSTANCE)),
        "json_object": ("json_object", None, compact(NESTED_INSTANCE)),
        "tool_call_required": ("tool_call", tools, "<tool_call>\n" + compact(TOOL_CALL_INSTANCE) + "\n</tool_call>"),
        "regex": ("regex", r"\d{3}-\d{4} [A-Z][a-z]+", "555-1234 Smith"),
        "choice": ("regex", "(positive|negative|neutral)", "neutral"),
    }


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, kind: str, source: Any) -> Any:
        xgr = self.xgr
        compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(source), any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(source)
        body = xgr.Grammar.from_json_schema(json.dumps(source), any_whitespace=False)
        grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), body,
                                     xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
        return compiler.compile_grammar(grammar)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids[0])
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.fill_fn = llguidance.torch.fill_next_token_bitmask

    def compile(self, kind: str, source: Any) -> Any:
        M = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(json.dumps(source))
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema('{"type": "object"}')
        elif kind == "regex":
            grammar = M.grammar_from_regex(source)
        else:
            grammar = M.grammar_from_lark('start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '
                                          + json.dumps(source))
        # llguidance compiles lazily: a matcher and its first mask are part of the compile
        m = M(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        self.fill(m)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tok, compiled)

    def fill(self, m: Any) -> None:
        self.fill_fn(m, self.bitmask, 0)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def walk(engine: Any, compiled: Any, tokens: list[int], stop_id: int) -> tuple[float, float]:
    """(us per token for fill + accept, us per token for fill alone) over a valid output + EOS."""
    m = engine.matcher(compiled)
    fill_s = total_s = 0.0
    for t in tokens + [stop_id]:
        t0 = time.perf_counter()
        engine.fill(m)
        t1 = time.perf_counter()
        ok = engine.accept(m, t)
        t2 = time.perf_counter()
        assert ok, f"{engine.name} refused token {t}"
        fill_s += t1 - t0
        total_s += t2 - t0
    n = len(tokens) + 1
    return total_s / n * 1e6, fill_s / n * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the default model's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from engine.default_model import default_model_path

    folder = Path(args.model) if args.model else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    stop = [tokenizer.eos_token_id]
    torch.set_num_threads(1)
    results: dict[str, Any] = {"model": folder.name, "vocab_size": vocab, "cpu": platform.processor() or platform.machine(),
                               "date": time.strftime("%Y-%m-%d"), "engines": {}}
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        engine = cls(tokenizer, vocab, stop)
        setup_s = time.perf_counter() - t0
        rows: dict[str, Any] = {"tokenizer_setup_ms": round(setup_s * 1e3, 1)}
        for name, (kind, source, text) in workloads().items():
            compile_s, compiled = timed(lambda e=engine, k=kind, s=source: e.compile(k, s), args.repeats)
            tokens = tokenizer.encode(text, add_special_tokens=False)
            per_tok = [walk(engine, compiled, tokens, stop[0]) for _ in range(args.repeats)]
            rows[name] = {"compile_ms": round(compile_s * 1e3, 2), "tokens": len(tokens) + 1,
                          "fill_accept_us_per_token": round(float(np.median([a for a, _ in per_tok])), 1),
                          "fill_us_per_token": round(float(np.median([b for _, b in per_tok])), 1)}
            print(f"{engine.name:10s} {name:20s} {rows[name]}", flush=True)
        results["engines"][engine.name] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
