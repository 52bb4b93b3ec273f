"""Tool calls out of a model's text, incrementally: text in (any split), events out (content, a call's
name, fragments of its JSON arguments), the same events whatever the split, so streamed deltas
assemble to the non-streamed message.

Four formats:
- hermes (Hermes 2 Pro, Qwen 2.5/3, and our own prompt for templates without tools):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, text around the calls is content.
- llama3_json (Llama 3.1+): the output is `{"name": "f", "parameters": {...}}`, several separated
  by ";"; an output that does not start with "{" is content.
- qwen3_coder (Qwen3-Coder): hermes' tags around `<function=f>`, then `<parameter=p>\\nvalue\\n</parameter>`
  per argument and `</function>`; a value is raw text, read as JSON where the function's schema
  gives the parameter another type than string. Its arguments stream one parameter at a time, as
  JSON; a `{...}` call inside the tags parses as hermes.
- mistral: `[TOOL_CALLS]` (a special token of Mistral's tokenizers, kept in the text for it) then
  either a list `[{"name": "f", "arguments": {...}}, ...]` (Mistral 7B v0.3, Mixtral, Nemo) or
  `f[ARGS]{...}`, once per call (the v11 tokenizers: Mistral Small 3.2, Devstral, Magistral).

A call's arguments stream as the exact text of its arguments object, from "{" to its matching "}".
A call whose object ends without the usual `{"name": ..., "arguments": ...}` order is parsed whole
at its end; one that does not parse is content, as it was written.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')
MISTRAL_OPEN = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
XML_FUNCTION = "<function="
XML_PARAMETER = "<parameter="
XML_PARAMETER_END = "</parameter>"
XML_FUNCTION_END = "</function>"
TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder")
TAGGED = ("hermes", "qwen3_coder")  # calls between <tool_call> tags, content around them
HEADER_CHARS = 256  # `{"name": "<64 characters at most>", "arguments":` with room for whitespace


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


Event = Content | CallStart | CallArgs


class _JsonDepth:
    """Where a JSON value that starts with "{" or "[" ends, one character at a time."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def step(self, ch: str) -> bool:
        """Whether ch closed the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag (kept back: it may be the tag's start)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _Call:
    text: str = ""  # the call's JSON object so far
    object_depth: _JsonDepth = field(default_factory=_JsonDepth)
    args_at: int | None = None  # where in text the arguments value starts, once the header is read
    args_depth: _JsonDepth | None = None
    args_done: bool = False
    index: int | None = None  # the call's index once its name is out


class ToolCallParser:
    def __init__(self, fmt: str, param_types: dict[str, dict[str, str]] | None = None) -> None:
        """param_types (qwen3_coder): per function, its parameters' JSON-schema types."""
        if fmt not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {fmt!r}; one of {', '.join(TOOL_PARSERS)}")
        self.fmt = fmt
        self.param_types = param_types or {}
        self.xml_args = ""  # qwen3_coder: the arguments' JSON so far
        self._steps = {"text": self._text, "start": self._start, "call": self._in_call, "after_call": self._after_call,
                       "mistral_open": self._mistral_open, "mistral_list": self._mistral_list,
                       "mistral_name": self._mistral_name, "mistral_args": self._mistral_args,
                       "xml_function": self._xml_function, "xml_params": self._xml_params,
                       "xml_value": self._xml_value}  # each state's step; "content" takes the rest as it is
        self.pending = ""  # text not yet turned into events
        self.state = "start" if fmt == "llama3_json" else "text"
        self.call: _Call | None = None
        self.num_calls = 0
        self.between_calls = False  # hermes: whitespace after a call's closing tag is dropped
        self.opening = ""  # mistral: the text from [TOOL_CALLS] until a call's name is out (content if none is)
        self.args: _JsonDepth | None = None  # mistral's name form: the arguments object being streamed

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        events: list[Event] = []
        while self.pending and self._advance(events):
            pass
        return _merge(events)

    def close(self) -> list[Event]:
        """The end of the output: held-back text is content; a call cut off before its name is out
        is content too (one cut later keeps its partial arguments, as streamed)."""
        events: list[Event] = []
        call = self.call
        if call is not None and call.index is None:
            events.append(Content(self._opened() + call.text))
        elif self.state in ("mistral_open", "mistral_name") or self.state == "mistral_list" and not self.num_calls:
            events.append(Content(self.opening))
        elif self.state == "xml_function":
            events.append(Content(HERMES_OPEN))
        self.call = None
        if self.pending and self.state not in ("after_call", "mistral_list", "mistral_args", "xml_params", "xml_value"):
            events.append(Content(self.pending))
        self.pending = ""
        return _merge(events)

    def _opened(self) -> str:
        """The text that opened the call being read (content again where it turns out not to be one)."""
        return {"hermes": HERMES_OPEN, "qwen3_coder": HERMES_OPEN, "mistral": self.opening}.get(self.fmt, "")

    # -- the states; each returns whether it made progress ------------------------------------

    def _advance(self, events: list[Event]) -> bool:
        step = self._steps.get(self.state)
        if step is not None:
            return step(events)
        events.append(Content(self.pending))  # "content": the rest is plain text
        self.pending = ""
        return False

    def _text(self, events: list[Event]) -> bool:
        if self.between_calls:
            self.pending = self.pending.lstrip()
            if not self.pending:
                return False
            self.between_calls = False
        tag = MISTRAL_OPEN if self.fmt == "mistral" else HERMES_OPEN
        at = self.pending.find(tag)
        if at < 0:
            keep = _held_prefix(self.pending, tag)
            if len(self.pending) > keep:
                events.append(Content(self.pending[:len(self.pending) - keep]))
                self.pending = self.pending[len(self.pending) - keep:]
            return False
        if at:
            events.append(Content(self.pending[:at]))
        if self.fmt == "mistral":
            self.pending, self.opening, self.state = self.pending[at + len(tag):], tag, "mistral_open"
            return True
        self.pending = self.pending[at + len(HERMES_OPEN):].lstrip()
        self.call, self.state = _Call(), "call"
        return True

    # -- qwen3_coder ----------------------------------------------------------------------------

    def _xml_function(self, events: list[Event]) -> bool:
        """`<function=name>`: the call starts once its name is out."""
        end = self.pending.find(">")
        if end < 0:
            if len(self.pending) > len(XML_FUNCTION) + 64 + 1:
                return self._not_xml(events)
            return False
        name = self.pending[len(XML_FUNCTION):end].strip()
        if not MISTRAL_NAME.match(name):
            return self._not_xml(events)
        self.pending, self.state, self.xml_args = self.pending[end + 1:], "xml_params", ""
        events.append(CallStart(self.num_calls, name))
        self._xml_name = name
        self.num_calls += 1
        return True

    def _not_xml(self, events: list[Event]) -> bool:
        events.append(Content(HERMES_OPEN))
        self.state = "text"
        return True

    def _xml_params(self, events: list[Event]) -> bool:
        """Between parameters: the next one, or the function's end."""
        text = self.pending.lstrip()
        if text.startswith(XML_PARAMETER):
            end = text.find(">")
            if end < 0:
                self.pending = text
                return False  # its name is still coming
            self._xml_param = text[len(XML_PARAMETER):end].strip()
            self.pending, self.state = text[end + 1:], "xml_value"
            return True
        if not text or XML_FUNCTION_END.startswith(text) or XML_PARAMETER.startswith(text):
            self.pending = text
            return False  # a tag still coming
        # the function's end (or anything else: the call ends there, and what follows is content)
        events.append(CallArgs(self.num_calls - 1, "}" if self.xml_args else "{}"))
        if text.startswith(XML_FUNCTION_END):
            text = text[len(XML_FUNCTION_END):]
        self.pending, self.state = text, "after_call"
        return True

    def _xml_value(self, events: list[Event]) -> bool:
        at = self.pending.find(XML_PARAMETER_END)
        if at < 0:
            return False
        raw = self.pending[:at]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        kind = self.param_types.get(self._xml_name, {}).get(self._xml_param, "string")
        value = json.dumps(raw, ensure_ascii=False)
        if kind != "string":
            try:
                value = json.dumps(json.loads(raw), ensure_ascii=False)
            except ValueError:
                pass  # not the type the schema says: kept as the text it is
        piece = ("{" if not self.xml_args else ", ") + json.dumps(self._xml_param, ensure_ascii=False) + ": " + value
        self.xml_args += piece
        events.append(CallArgs(self.num_calls - 1, piece))
        self.pending, self.state = self.pending[at + len(XML_PARAMETER_END):], "xml_params"
        return True

    # -- mistral -------------------------------------------------------------------------------

    def _mistral_open(self, events: list[Event]) -> bool:
        """Past [TOOL_CALLS]: a list of call objects, or a name and [ARGS]."""
        text = self.pending.lstrip()
        self.opening += self.pending[:len(self.pending) - len(text)]
        if not text:
            self.pending = ""
            return False
        if text[0] == "[":
            self.opening += "["
            self.pending, self.state = text[1:], "mistral_list"
        else:
            self.pending, self.state = text, "mistral_name"
        return True

    def _mistral_list(self, events: list[Event]) -> bool:
        """Between the list's call objects: a comma, the next object, or the list's end."""
        text = self.pending.lstrip().lstrip(",").lstrip()
        if not text:
            self.pending = ""
            return False
        if text[0] == "]":
            self.pending, self.state, self.between_calls = text[1:], "text", True
        elif text[0] == "{":
            if not self.num_calls:
                self.opening += self.pending[:len(self.pending) - len(text)]
            self.pending, self.call, self.state = text, _Call(), "call"
        else:  # not a list of calls after all: the rest is content
            events.append(Content(self.opening if not self.num_calls else ""))
            self.state = "content"
        return True

    def _mistral_name(self, events: list[Event]) -> bool:
        at = self.pending.find(MISTRAL_ARGS)
        name = self.pending[:at].strip() if at >= 0 else ""
        if at < 0 and len(self.pending) <= 64 + len(MISTRAL_ARGS) + 8:
            return False  # the name may still be coming
        if at < 0 or not MISTRAL_NAME.match(name):  # not a call after all: content, as written
            events.append(Content(self.opening))
            self.state = "text"
            return True
        self.opening += self.pending[:at + len(MISTRAL_ARGS)]
        self.pending, self.state = self.pending[at + len(MISTRAL_ARGS):], "mistral_args"
        self._name = name
        return True

    def _mistral_args(self, events: list[Event]) -> bool:
        """The name form's arguments object, streamed as it comes; the next [TOOL_CALLS] may follow."""
        if self.args is None:
            text = self.pending.lstrip()
            if not text:
                self.pending = ""
                return False
            if text[0] != "{":
                events.append(Content(self.opening))
                self.pending, self.state = text, "text"
                return True
            self.pending, self.args = text, _JsonDepth()
            events.append(CallStart(self.num_calls, self._name))
            self.num_calls += 1
        for i, ch in enumerate(self.pending):
            if self.args.step(ch):
                events.append(CallArgs(self.num_calls - 1, self.pending[:i + 1]))
                self.pending, self.args, self.state, self.between_calls = self.pending[i + 1:], None, "text", True
                return True
        events.append(CallArgs(self.num_calls - 1, self.pending))
        self.pending = ""
        return False

    def _start(self, events: list[Event]) -> bool:
        """llama3_json: a call if the output (past whitespace and the python tag) opens an object."""
        text = self.pending.lstrip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].lstrip()
        if not text or (len(text) < len(PYTHON_TAG) and PYTHON_TAG.startswith(text)):
            return False  # nothing decisive yet
        if text[0] == "{":
            self.pending = text
            self.call, self.state = _Call(), "call"
        else:
            self.state = "content"
        return True

    def _in_call(self, events: list[Event]) -> bool:
        call = self.call
        assert call is not None
        if not call.text:
            self.pending = self.pending.lstrip()
            if not self.pending:
                return False
            if self.fmt == "qwen3_coder" and self.pending[0] == "<":
                if self.pending.startswith(XML_FUNCTION):
                    self.call, self.state = None, "xml_function"
                    return True
                if XML_FUNCTION.startswith(self.pending):
                    return False  # may still become <function=
            if self.pending[0] != "{":  # not a JSON object after all: content, as written
                events.append(Content(self._opened()))
                self.call, self.state = None, "text" if self.fmt in TAGGED else "content"
                return True
        for i, ch in enumerate(self.pending):
            call.text += ch
            if call.args_at is None:
                # past HEADER_CHARS without the usual header the call is parsed whole at its end (and
                # the match, tried per character, stays cheap)
                m = _HEADER.match(call.text) if len(call.text) <= HEADER_CHARS else None
                if m is not None:
                    call.args_at = m.end()
            elif call.args_depth is None and not call.args_done:
                if ch.isspace():
                    call.args_at = len(call.text)
                elif ch in "{[":
                    call.args_at = len(call.text) - 1
                    call.args_depth = _JsonDepth()
                    self._start_call(call, events)
                else:
                    call.args_done = True  # not an object: parsed whole at the call's end
            if call.args_depth is not None and not call.args_done:
                events.append(CallArgs(call.index, ch))
                if call.args_depth.step(ch):
                    call.args_done = True
            if call.object_depth.step(ch):
                self.pending = self.pending[i + 1:]
                self._end_call(call, events)
                return True
        self.pending = ""
        return False

    def _start_call(self, call: _Call, events: list[Event]) -> None:
        m = _HEADER.match(call.text)
        assert m is not None
        call.index = self.num_calls
        self.num_calls += 1
        events.append(CallStart(call.index, json.loads(f'"{m.group(1)}"')))

    def _end_call(self, call: _Call, events: list[Event]) -> None:
        self.call = None
        self.state = "mistral_list" if self.fmt == "mistral" else "after_call"
        if call.index is not None and call.args_done:
            return
        if call.index is None:  # not in the usual order: the whole object decides
            try:
                obj = json.loads(call.text)
                name = obj["name"]
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                if not isinstance(name, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                events.append(Content(self._opened() + call.text))
                self.state = "content" if self.fmt == "llama3_json" else "text"
                return
            index = self.num_calls
            self.num_calls += 1
            events.append(CallStart(index, name))
            events.append(CallArgs(index, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))

    def _after_call(self, events: list[Event]) -> bool:
        """Past a call's object: hermes' closing tag, llama3_json's ";" before the next call."""
        text = self.pending.lstrip()
        if not text:
            self.pending = ""
            return False
        if self.fmt in TAGGED:
            if text.startswith(HERMES_CLOSE):
                self.pending = text[len(HERMES_CLOSE):]
                self.state, self.between_calls = "text", True
                return True
            if HERMES_CLOSE.startswith(text):
                self.pending = text
                return False
            self.pending, self.state = text, "text"
            return True
        if text[0] == ";":
            self.pending, self.state = text[1:], "start"
            return True
        self.pending, self.state = text, "content"
        return True


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent content, or adjacent fragments of one call's arguments, as one event."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Content) and isinstance(last, Content) or isinstance(e, CallArgs) and isinstance(last, CallArgs) and last.index == e.index:
            last.text += e.text
        elif not (isinstance(e, (Content, CallArgs)) and not e.text):
            out.append(e)
    return out


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""


def in_order(events: list[Event]) -> list[str | ParsedCall]:
    """What a sequence of events adds up to, in order: runs of content (non-empty) and the calls
    between them (a Responses API output's message and function_call items)."""
    out: list[str | ParsedCall] = []
    calls: list[ParsedCall] = []
    for e in events:
        if isinstance(e, Content):
            if not e.text:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += e.text
            else:
                out.append(e.text)
        elif isinstance(e, CallStart):
            calls.append(ParsedCall(e.name))
            out.append(calls[-1])
        else:
            calls[e.index].arguments += e.text
    return out


def assemble(events: list[Event]) -> tuple[str, list[ParsedCall]]:
    """The content and the calls that a sequence of events adds up to."""
    parts = in_order(events)
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ParsedCall)]


def _events(text: str, fmt: str, param_types: dict[str, dict[str, str]] | None) -> list[Event]:
    """A whole output's events, as its stream would give them."""
    parser = ToolCallParser(fmt, param_types)
    return parser.feed(text) + parser.close()


def parse_in_order(text: str, fmt: str, param_types: dict[str, dict[str, str]] | None = None
                   ) -> list[str | ParsedCall]:
    return in_order(_events(text, fmt, param_types))


def parse_all(text: str, fmt: str, param_types: dict[str, dict[str, str]] | None = None
              ) -> tuple[str, list[ParsedCall]]:
    return assemble(_events(text, fmt, param_types))
