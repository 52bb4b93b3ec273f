"""Grammars for constrained decoding, with llguidance: what a request may ask for (a JSON schema,
any JSON object, a regex, a choice list, a Lark or GBNF grammar, a tool call) turned into one
grammar string, and the check that it compiles against the model's tokenizer.

Torch-free: the server validates grammars here, beside its event loop; the runner builds the
per-sequence matchers from the same strings (engine/grammar_mask.py). A grammar travels to the
engine as its string (SamplingParams.grammar), so it pickles to an engine process as it is.

JSON is generated compactly (", " and ": " between items, no other whitespace): a model left free
to add whitespace can add it forever, and a small one does.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

# how the generated JSON looks (llguidance's "x-guidance" options)
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder")


class GrammarError(ValueError):
    """The grammar or schema cannot be used; the message says why."""


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GrammarError("the grammar engine llguidance is not installed (pip install llguidance)") from None
    return llguidance


def json_schema_grammar(schema: dict[str, Any]) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object")
    return _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_FORMAT)


def json_object_grammar() -> str:
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    return _llg().LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return _llg().grammar_from("choice", json.dumps(choices))


def ebnf_grammar(text: str) -> str:
    """A Lark grammar (llguidance's syntax, `start:` rule) or a GBNF one (`root ::=`)."""
    try:
        return _llg().grammar_from("grammar", text)
    except Exception as e:  # its parse errors are plain exceptions with a readable message
        raise GrammarError(f"the grammar does not parse: {first_line(str(e))}") from None


def tool_call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """One call of any of the tools (OpenAI function definitions): {"name": ..., args_key: {...}}."""
    branches = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        branches.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                         "required": ["name", args_key], "additionalProperties": False})
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def tool_call_grammar(tools: list[dict[str, Any]], fmt: str, parallel: bool, open_token: int | None = None,
                      args_tag: bool = False) -> str:
    """Output that is only tool calls, each of one of `tools`, in the model's format: hermes
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (one per line when parallel),
    llama3_json `{"name": ..., "parameters": {...}}` (several separated by "; "), mistral
    `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or with args_tag `[TOOL_CALLS]name[ARGS]{...}`
    per call. open_token: the id of the one token that is `[TOOL_CALLS]` (else it is written as text)."""
    if fmt not in TOOL_FORMATS:
        raise GrammarError(f"unknown tool-call format {fmt!r}; one of {', '.join(TOOL_FORMATS)}")
    if fmt == "mistral":
        return _llg().LLMatcher.grammar_from_lark(_mistral_calls(tools, parallel, open_token, args_tag))
    if fmt == "qwen3_coder":
        return _llg().LLMatcher.grammar_from_lark(_xml_calls(tools, parallel))
    schema = tool_call_schema(tools, "arguments" if fmt == "hermes" else "parameters")
    call = "%json " + json.dumps({**schema, "x-guidance": JSON_FORMAT})
    if fmt == "hermes":
        block = 'call: "<tool_call>\\n" ' + call + ' "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        block = "call: " + call
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return _llg().LLMatcher.grammar_from_lark(start + "\n" + block + "\n")


def _mistral_calls(tools: list[dict[str, Any]], parallel: bool, open_token: int | None, args_tag: bool) -> str:
    opener = f"<[{open_token}]>" if open_token is not None else json.dumps("[TOOL_CALLS]")
    if not args_tag:
        schema = tool_call_schema(tools, "arguments")
        call = "%json " + json.dumps({**schema, "x-guidance": JSON_FORMAT})
        more = ' (", " call)*' if parallel else ""
        return f'start: {opener} "[" call{more} "]"\ncall: {call}\n'
    branches = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        branches.append(json.dumps(fn["name"] + "[ARGS]") + " %json " + json.dumps({**params, "x-guidance": JSON_FORMAT}))
    return f'start: call{"+" if parallel else ""}\ncall: {opener} ({" | ".join(branches)})\n'


def _xml_calls(tools: list[dict[str, Any]], parallel: bool) -> str:
    """Qwen3-Coder's calls: `<function=f>` and a `<parameter=p>` block per argument, in the schema's
    order (the optional ones may be left out); a string is raw text up to the block's end (an enum one
    of its values, maxLength and minLength held), any other type JSON of its schema."""
    rules, functions = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        schema = fn.get("parameters") or {}
        required = set(schema.get("required") or [])
        parts = []
        for name, spec in (schema.get("properties") or {}).items():
            spec = spec if isinstance(spec, dict) else {}
            block = json.dumps(f"<parameter={name}>\n") + " " + _xml_value(spec, rules)
            parts.append(block if name in required else f"({block})?")
        functions.append(f"fn{i}")
        rules.append(f"fn{i}: {json.dumps(fn['name'] + '>' + chr(10))} {' '.join(parts)}".rstrip())
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f'call: "<tool_call>\\n<function=" ({" | ".join(functions)}) "</function>\\n</tool_call>"',
                      *rules, f"text{XML_VALUE_END}: /(?s:.*)/", ""])


XML_VALUE_END = '[suffix="\\n</parameter>\\n"]'  # a rule's text ends at the first "\n</parameter>\n", which follows


def _xml_value(spec: dict[str, Any], rules: list[str]) -> str:
    """The grammar of one parameter's value and its block's end (a rule for a bounded string goes to rules)."""
    if spec.get("type", "string") != "string":
        return "%json " + json.dumps({**spec, "x-guidance": JSON_FORMAT}) + " " + json.dumps("\n</parameter>\n")
    if isinstance(spec.get("enum"), list) and spec["enum"] and all(isinstance(v, str) for v in spec["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in spec["enum"]) + ") " + json.dumps("\n</parameter>\n")
    lo, hi = spec.get("minLength"), spec.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        name = f"bounded{len(rules)}"
        rules.append(f"{name}{XML_VALUE_END}: /(?s:.{{{lo or 0},{hi if isinstance(hi, int) else ''}}})/")
        return name
    return "text"


def after_thinking(grammar: str, close_id: int, open_id: int | None = None, must_open: bool = False) -> str:
    """grammar, after a reasoning model's thinking: any text up to the close_id token, then the answer,
    held to grammar. open_id: the output may open its thinking with this token first (must_open: the
    thinking is there only if opened, else the answer starts at once). The thinking cannot end the
    output: end-of-sequence is allowed only once the answer is complete."""
    spec = json.loads(grammar)
    answer, *rest = spec["grammars"]
    answer = {**answer, "name": answer.get("name") or "answer_after_thinking"}
    thought = f"THOUGHT <[{close_id}]>"
    if open_id is not None:
        thought = f"(<[{open_id}]> {thought})?" if must_open else f"<[{open_id}]>? {thought}"
    lark = f"start: {thought} @{answer['name']}\nTHOUGHT: /(?s:.*)/\n"
    return json.dumps({**spec, "grammars": [{"lark_grammar": lark}, answer, *rest]})


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return line[:limit]


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it, built on first use (~0.6 s for a 49k
    vocabulary) and shared by the threads that compile grammars or fill masks."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        # an end-of-sequence id past the vocabulary (a config's, beside another tokenizer) is never
        # sampled, and llguidance refuses it
        self.eos_token_ids = [i for i in eos_token_ids if 0 <= i < vocab_size] or [hf_tokenizer.eos_token_id]
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def supported(hf_tokenizer: Any) -> str | None:
        """Why this tokenizer can't constrain decoding, or None."""
        import importlib.util

        if importlib.util.find_spec("llguidance") is None:
            return "the grammar engine llguidance is not installed (pip install llguidance)"
        if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
            return "this model folder has no Hugging Face fast tokenizer (tokenizer.json)"
        if getattr(hf_tokenizer, "eos_token_id", None) is None:
            return "the model's tokenizer names no end-of-sequence token"
        return None

    def get(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self.eos_token_ids)
                except TypeError:  # older llguidance (1.6) takes one end-of-sequence token
                    self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                   eos_token=self.hf_tokenizer.eos_token_id)
            return self._tokenizer


class GrammarCompiler:
    """Checks that a grammar string compiles for the model and remembers the ones that did (by
    their text, most recent kept). Thread-safe; a compile of a few ms, run off the event loop."""

    def __init__(self, tokenizer: GrammarTokenizer, cache_size: int = 512) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._ok: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> str:
        """grammar, once it has compiled; GrammarError with llguidance's reason otherwise."""
        with self._lock:
            if grammar in self._ok:
                self._ok.move_to_end(grammar)
                return grammar
        llg = _llg()
        tokenizer = self.tokenizer.get()
        try:
            matcher = llg.LLMatcher(tokenizer, grammar)
        except Exception as e:  # llguidance raises plain exceptions for grammars it can't read
            raise GrammarError(first_line(str(e))) from None
        if matcher.is_error():
            raise GrammarError(first_line(matcher.get_error()))
        # the first mask builds the lexer: an expensive grammar shows here, inside the time limit
        import numpy as np

        mask = np.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            raise GrammarError(first_line(matcher.get_error()))
        with self._lock:
            self._ok[grammar] = None
            while len(self._ok) > self.cache_size:
                self._ok.popitem(last=False)
        return grammar
