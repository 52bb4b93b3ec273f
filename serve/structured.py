"""A request's structured-output fields -> one grammar string (engine/grammar.py), or None.

OpenAI's response_format ({"type": "text" | "json_object" | "json_schema"}) and vLLM's extensions
(structured_outputs {json | regex | choice | grammar}, and the older guided_json, guided_regex,
guided_choice, guided_grammar). At most one of them per request. Whether the grammar compiles for
the model is checked later, off the event loop (serve/api.py).
"""
from __future__ import annotations

import json
from typing import Any

from engine.grammar import (GrammarError, choice_grammar, ebnf_grammar, json_object_grammar, json_schema_grammar,
                            regex_grammar)
from serve.errors import APIError
from serve.protocol import SamplingFields

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise APIError(400, f"{param} is not valid JSON; send a JSON schema object", param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    return value


def _response_format(rf: dict[str, Any]) -> str | None:
    kind = rf.get("type")
    if kind not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., "schema": {...}}',
                       param="response_format")
    schema = spec.get("schema")
    if schema is None:
        # a bare schema in place of the wrapper, as some clients send
        schema = {k: v for k, v in spec.items() if k not in ("name", "description", "strict")} or None
    if schema is None:
        raise APIError(400, "response_format.json_schema.schema is required", param="response_format")
    return json_schema_grammar(_schema(schema, "response_format.json_schema.schema"))


def request_grammar(req: SamplingFields) -> tuple[str, str] | None:
    """(the grammar the request's structured-output fields ask for, the field) or None
    (unconstrained); 400 for a malformed or ambiguous request."""
    so = req.structured_outputs
    asked: list[tuple[str, Any]] = []
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        asked.append(("response_format", req.response_format))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            asked.append((name, getattr(req, name)))
    if so is not None:
        for name, value in (("json", so.json_schema), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar)):
            if value is not None:
                asked.append((f"structured_outputs.{name}", value))
    if req.response_format is not None and "type" not in req.response_format:
        raise APIError(400, "response_format needs a type: text, json_object or json_schema", param="response_format")
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"ask for one structured output at a time; got {', '.join(n for n, _ in asked)}",
                       param=asked[1][0].split(".")[0])
    name, value = asked[0]
    param = name.split(".")[0]
    try:
        if name == "response_format":
            grammar = _response_format(value)
        elif name.endswith("json"):
            grammar = json_schema_grammar(_schema(value, name))
        elif name.endswith("regex"):
            grammar = regex_grammar(value)
        elif name.endswith("choice"):
            grammar = choice_grammar(value)
        else:
            grammar = ebnf_grammar(value)
    except GrammarError as e:
        raise APIError(400, f"{name}: {e}", param=param) from None
    return None if grammar is None else (grammar, param)
