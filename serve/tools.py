"""Tool calling on /v1/chat/completions: which format the model calls tools in, how the tools and
earlier calls reach the prompt, and the grammar that enforces `tool_choice` "required" or a named
function (so that every call's arguments parse and match the function's schema).

The format (--tool-parser): hermes (`<tool_call>` tags, Hermes 2 Pro / Qwen), llama3_json, mistral
(`[TOOL_CALLS]`) or qwen3_coder (`<function=...>` inside the tags); auto picks llama3_json for a
Llama 3 chat template, mistral for one that writes `[TOOL_CALLS]`, qwen3_coder for one that writes
`<function=`, and hermes otherwise. A chat template that
renders `tools` itself (it mentions them) gets them through transformers' apply_chat_template; for
one that does not (the default SmolLM2's), the tools are described in the system message in the
chosen format, and earlier calls and results are written into the turns as that format has them.
tool_choice "none" leaves the tools out of the prompt; "auto" lets the model choose (its output is
parsed, not constrained).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.grammar import GrammarError, tool_call_grammar
from serve.errors import APIError
from serve.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from serve.tool_parser import MISTRAL_OPEN

TOOL_PARSER_CHOICES = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder")


def resolve_tool_parser(choice: str, chat_template: str | None) -> str:
    if choice not in TOOL_PARSER_CHOICES:
        raise ValueError(f"tool parser must be one of {', '.join(TOOL_PARSER_CHOICES)}; got {choice!r}")
    if choice != "auto":
        return choice
    template = chat_template or ""
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<function=" in template:
        return "qwen3_coder"
    return "hermes"


@dataclass(frozen=True)
class ToolFormat:
    """How this model writes tool calls: the parser's format, and for mistral the id of the one
    token `[TOOL_CALLS]` (None: it is text) and whether calls are `name[ARGS]{...}` (its v11
    templates write `[ARGS]`) rather than a list of objects."""
    parser: str
    open_token: int | None = None
    args_tag: bool = False

    @classmethod
    def of(cls, parser: str, tokenizer: Any, chat_template: str | None) -> "ToolFormat":
        if parser != "mistral":
            return cls(parser)
        try:
            ids = list(tokenizer.encode(MISTRAL_OPEN, add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a folder without a tokenizer: the tag stays text
            ids = []
        return cls(parser, ids[0] if len(ids) == 1 else None, "[ARGS]" in (chat_template or ""))


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


@dataclass
class ToolPlan:
    parser: str | None = None  # the format the output is parsed in; None: no tool calls expected
    grammar: str | None = None  # what the output must be ("required", a named function)
    check: str | None = None  # a grammar that must compile: the tools' schemas are valid
    tools: list[dict[str, Any]] | None = None  # to render in the prompt
    param_types: dict[str, dict[str, str]] | None = None  # qwen3_coder: each function's parameters' types


def plan_tools(req: ChatCompletionRequest, tool_format: ToolFormat) -> ToolPlan:
    fmt = tool_format.parser
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools; send tools or leave tool_choice out", param="tool_choice")
        return ToolPlan()
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan()
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools have duplicate names; give each function its own name", param="tools")
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not chosen:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                f"({', '.join(names)})", param="tool_choice")
    try:
        grammar = tool_call_grammar(chosen, fmt, parallel=req.parallel_tool_calls and choice == "required",
                                    open_token=tool_format.open_token, args_tag=tool_format.args_tag)
    except GrammarError as e:
        raise APIError(400, f"tools: {e}", param="tools") from None
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    types = {t["function"]["name"]: param_types(t["function"].get("parameters")) for t in tools} \
        if fmt == "qwen3_coder" else None
    return ToolPlan(fmt, grammar if forced else None, grammar, tools, types)


def param_types(schema: dict[str, Any] | None) -> dict[str, str]:
    """A function's parameters' JSON types (the first that is not null; "string" where none is given)."""
    out = {}
    for name, spec in ((schema or {}).get("properties") or {}).items():
        kind = spec.get("type", "string") if isinstance(spec, dict) else "string"
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        out[name] = kind if isinstance(kind, str) else "string"
    return out


# -- the prompt ----------------------------------------------------------------------------------

# the tools inside <tools></tools>, as Hermes and Qwen list them
TAGGED_TOOLS = """# Tools

You may call one or more of the functions below to help with the user's request. Each is described \
as a JSON schema inside <tools></tools>:
<tools>
{tools}
</tools>

"""

HERMES_SYSTEM = TAGGED_TOOLS + """To call a function, answer with its name and arguments as a JSON object inside \
<tool_call></tool_call> tags:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""

LLAMA3_SYSTEM = """# Tools

You may call one of the functions below to help with the user's request. Each is described as a JSON schema:
{tools}

To call a function, answer with only a JSON object of the form \
{{"name": <function name>, "parameters": <arguments as a JSON object>}}."""

MISTRAL_SYSTEM = """# Tools

You may call one or more of the functions below to help with the user's request. Each is described as a JSON schema:
{tools}

To call functions, answer with [TOOL_CALLS] and a JSON list of calls: \
[TOOL_CALLS][{{"name": <function name>, "arguments": <arguments as a JSON object>}}]"""

QWEN3_CODER_SYSTEM = TAGGED_TOOLS + """To call a function, answer with its name and each argument in a block of its own:
<tool_call>
<function=the function's name>
<parameter=an argument's name>
its value
</parameter>
</function>
</tool_call>"""
SYSTEM_PROMPTS = {"hermes": HERMES_SYSTEM, "llama3_json": LLAMA3_SYSTEM, "mistral": MISTRAL_SYSTEM,
                  "qwen3_coder": QWEN3_CODER_SYSTEM}


def _arguments(text: str) -> Any:
    """An earlier call's arguments as the templates want them: an object where they parse."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_text(name: str, arguments: str, fmt: str) -> str:
    args = json.dumps(_arguments(arguments), ensure_ascii=False)
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'
    if fmt == "mistral":
        return f'{MISTRAL_OPEN}[{{"name": {json.dumps(name)}, "arguments": {args}}}]'
    if fmt == "qwen3_coder":
        values = _arguments(arguments)
        shown = {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                 for k, v in values.items()} if isinstance(values, dict) else {}
        blocks = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in shown.items())
        return f"<tool_call>\n<function={name}>\n{blocks}</function>\n</tool_call>"
    return f'{{"name": {json.dumps(name)}, "parameters": {args}}}'


def chat_messages(messages: list[dict[str, Any]], originals: list[ChatMessage], plan: ToolPlan, fmt: str,
                  template_has_tools: bool) -> list[dict[str, Any]]:
    """The messages for apply_chat_template: earlier tool calls and results in the shape the
    template takes (its own, or our format written into plain turns), and our tool description in
    the system message where the template cannot render tools."""
    out = []
    for m, orig in zip(messages, originals):
        if orig.tool_calls:
            if template_has_tools:
                m = {**m, "tool_calls": [{"id": c.id, "type": "function",
                                          "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                         for c in orig.tool_calls]}
            else:
                calls = "\n".join(_call_text(c.function.name, c.function.arguments, fmt) for c in orig.tool_calls)
                m = {**m, "content": (m["content"] + "\n" if m["content"] else "") + calls}
        if orig.role == "tool":
            if template_has_tools:
                m = {**m, **({"tool_call_id": orig.tool_call_id} if orig.tool_call_id else {})}
            elif fmt in ("hermes", "qwen3_coder"):
                m = {**m, "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if plan.tools and not template_has_tools:
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
        text = SYSTEM_PROMPTS[fmt].format(tools=lines)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
