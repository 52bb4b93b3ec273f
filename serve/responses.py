"""OpenAI's Responses API on the chat path: a request's input items (and those of the stored
conversation it continues) become chat messages, its fields a ChatCompletionRequest, so the chat
template, tools, structured output and reasoning parser work as on /v1/chat/completions.

Stored responses (store: true, OpenAI's default) are JSON files in a folder every API process of the
server shares, so previous_response_id and GET /v1/responses/{id} work whichever process answers;
each process keeps its last STORE_LIMIT (at most STORE_BYTES) and drops older ones (the folder:
serve/run_cmd.py names it in RESPONSES_DIR_ENV). They live as long as the server.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from serve.errors import APIError, validation_message
from serve.prompts import check_text
from serve.protocol import ChatCompletionRequest, SamplingFields
from serve.responses_protocol import ResponsesRequest

# stored responses per API process, and their bytes: each holds its whole conversation, so a long one
# costs up to its context's text (~0.5 MB for 128k tokens)
STORE_LIMIT = 4096
STORE_BYTES = 256 * 2**20
LOGPROBS_INCLUDE = "message.output_text.logprobs"
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# fields of the chat request the Responses API spells otherwise, or that have no place here
NOT_PASSED = {"n", "stream_options", "model"}
# a chat-path error's parameter, as this request names it
PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
          "max_completion_tokens": "max_output_tokens", "response_format": "text.format", "logprobs": "include"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- input items ---------------------------------------------------------------------------------

def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items in one shape (a string is one user message), each with an id:
    what a stored response keeps of its input. 400 naming the item for anything else."""
    if isinstance(body.input, str):
        return [_message("user", [{"type": "input_text", "text": check_text(body.input, "input")}])]
    if not body.input:
        raise APIError(400, "input is an empty list; send a string or at least one item", param="input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(body.input)]


def _message(role: str, content: list[dict[str, Any]], item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "role": role, "content": content}


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where} must be a string", param=where)
    return check_text(value, where)


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object (a message or a function_call / function_call_output item)",
                       param=where)
    kind = item.get("type", "message" if "role" in item else None)
    item_id = item.get("id") if isinstance(item.get("id"), str) else None
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=where)
        return _message(role, _content(item.get("content"), role, f"{where}.content"), item_id)
    if kind == "function_call":
        return {"type": "function_call", "id": item_id or new_id("fc"),
                "call_id": _text(item.get("call_id"), f"{where}.call_id"),
                "name": _text(item.get("name"), f"{where}.name"),
                "arguments": _text(item.get("arguments"), f"{where}.arguments"), "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        text = _text(output, f"{where}.output") if not isinstance(output, list) else \
            _joined(_content(output, "user", f"{where}.output"))
        return {"type": "function_call_output", "id": item_id or new_id("fco"),
                "call_id": _text(item.get("call_id"), f"{where}.call_id"), "output": text}
    if kind == "reasoning":
        return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": item.get("summary") or [],
                "content": item.get("content") or []}
    if kind == "item_reference":
        raise APIError(400, f"{where}: item references are not supported; send the item itself, or continue a stored "
                            "response with previous_response_id", param=where)
    raise APIError(400, f"{where}.type {kind!r} is not supported here; send messages, function_call and "
                        "function_call_output items", param=where)


def _content(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    """A message's content as text parts (input_text, or output_text for the assistant's)."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": kind, "text": check_text(content, where)}]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of input_text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype in TEXT_PARTS:
            parts.append({"type": kind, "text": _text(part.get("text"), f"{at}.text")})
        elif ptype == "refusal":
            parts.append({"type": kind, "text": _text(part.get("refusal"), f"{at}.refusal")})
        elif ptype in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{at} is an {ptype} part; this server serves a text-only model: send text parts",
                           param=where)
        else:
            raise APIError(400, f"{at} must be an input_text part ({{\"type\": \"input_text\", \"text\": ...}})",
                           param=where)
    return parts


def _joined(parts: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for p in parts)


# -- the chat request ----------------------------------------------------------------------------

def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages of a conversation's items: a function_call joins the assistant turn before it (or
    starts one), its output is a tool message, and earlier reasoning stays out of the prompt as chat
    templates leave it out."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _joined(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not messages:
        raise APIError(400, "the input has no message to answer (only reasoning items)", param="input")
    return messages


def check_supported(body: ResponsesRequest) -> None:
    if body.background:
        raise APIError(400, "background responses are not supported; leave background out (or false)",
                       param="background")
    if body.conversation is not None:
        raise APIError(400, "conversation objects are not supported; continue a stored response with "
                            "previous_response_id", param="conversation")
    if body.n != 1:
        raise APIError(400, "n is not a field of the Responses API: one response per request", param="n")
    if body.metadata is not None and (len(body.metadata) > 16 or any(len(k) > 64 or len(v) > 512
                                                                      for k, v in body.metadata.items())):
        raise APIError(400, "metadata holds at most 16 pairs, keys of at most 64 characters and values of at most "
                            "512", param="metadata")


def chat_request(body: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves body over the conversation's items (earlier ones first)."""
    fields = body.model_dump(include=set(SamplingFields.model_fields) - NOT_PASSED, by_alias=True, exclude_unset=True)
    logprobs = LOGPROBS_INCLUDE in (body.include or []) or body.top_logprobs is not None
    fields.update(
        messages=chat_messages(items, body.instructions), max_completion_tokens=body.max_output_tokens,
        logprobs=logprobs, top_logprobs=body.top_logprobs if logprobs else None,
        parallel_tool_calls=body.parallel_tool_calls, chat_template_kwargs=body.chat_template_kwargs,
        tools=[_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice))
    if body.text is not None:
        fields["response_format"] = _text_format(body.text)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # a message or tool the chat path can't take, said in this request's terms
        message, param = validation_message(e.errors(include_url=False))
        raise APIError(400, message, param=PARAMS.get(param or "", param)) from None


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise APIError(400, f"{where}.type is {kind!r}; this server runs only function tools (the application runs "
                            "them and sends back function_call_output items)", param="tools")
    name = tool.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise APIError(400, f"{where}.name must be 1-64 letters, digits, _ . or -", param="tools")
    for key, types in (("description", str), ("parameters", dict), ("strict", bool)):
        if tool.get(key) is not None and not isinstance(tool[key], types):
            raise APIError(400, f"{where}.{key} must be a {'string' if types is str else types.__name__}",
                           param="tools")
    spec = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": spec}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                   param="tool_choice")


def _text_format(text: dict[str, Any]) -> dict[str, Any] | None:
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, 'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                            '"name": ..., "schema": {...}}', param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(400, 'text.format {"type": "json_schema"} needs "schema": a JSON schema object',
                       param="text.format")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def without_oldest_turn(items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """truncation "auto": the conversation less its first item, and any that would then lead it
    without the turn they belong to (a call's output, the assistant's part); None when nothing
    would be left to answer."""
    rest = items[1:]
    while rest and not (rest[0]["type"] == "message" and rest[0]["role"] != "assistant"):
        rest = rest[1:]
    return rest or None


def renamed(e: APIError) -> APIError:
    """A chat-path error in this request's terms: its parameter, and the field names in its message."""
    param = PARAMS.get(e.param or "", e.param)
    if e.param and e.param.startswith("messages["):
        param = "input"
    message = e.message.replace("max_tokens", "max_output_tokens").replace("response_format", "text.format")
    return APIError(e.status, message, param=param, code=e.code, headers=e.headers)


# -- the store -----------------------------------------------------------------------------------

class ResponseStore:
    """Stored responses, each with the conversation it ends (input items and output, without the
    instructions, which previous_response_id does not carry over), as JSON files in one folder."""

    def __init__(self, folder: str | None = None, limit: int = STORE_LIMIT, max_bytes: int = STORE_BYTES) -> None:
        """folder: shared with the server's other API processes; None: a folder of this store's own,
        removed by close()."""
        self.own = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="pagedserve-responses-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limit, self.max_bytes = limit, max_bytes
        self._mine: deque[tuple[str, int]] = deque()  # (id, bytes) of what this process stored, oldest first
        self._bytes = 0

    def _path(self, response_id: str) -> Path | None:
        return self.folder / f"{response_id}.json" if re.fullmatch(r"resp_[0-9a-f]{32}", response_id) else None

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        path = self._path(response["id"])
        assert path is not None, response["id"]
        data = json.dumps({"response": response, "conversation": conversation}, ensure_ascii=False).encode()
        part = path.with_suffix(".part")
        part.write_bytes(data)
        os.replace(part, path)  # whole or not at all, for a reader in another process
        self._mine.append((response["id"], len(data)))
        self._bytes += len(data)
        while len(self._mine) > self.limit or self._bytes > self.max_bytes and len(self._mine) > 1:
            old, size = self._mine.popleft()
            self._bytes -= size
            self.delete(old)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        path = self._path(response_id)
        try:
            stored = json.loads(path.read_text()) if path is not None else None
        except FileNotFoundError:
            return None
        return None if stored is None else (stored["response"], stored["conversation"])

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id)
        try:
            if path is not None:
                path.unlink()
                return True
        except FileNotFoundError:
            pass
        return False

    def close(self) -> None:
        if self.own:
            shutil.rmtree(self.folder, ignore_errors=True)
