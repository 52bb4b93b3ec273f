"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can see goes through here. Messages say what to fix and never carry a
traceback, a file path or a Python type name from our side; unexpected exceptions are logged in
full and answered with a generic 500.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("pagedserve")

# What a field accepts, for fields whose pydantic errors would list every branch of a union.
FIELD_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids (integers) or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error"),
                      "param": param, "code": code}}


def _clip(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence (and the first offending parameter) from pydantic's errors."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next((e.get("ctx", {}).get("error") for e in errors if e.get("type") == "json_invalid"), None)
        return f"the request body is not valid JSON{f' ({detail})' if detail else ''}", None
    parts: list[str] = []
    first_param: str | None = None
    seen: set[str] = set()
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if not loc:
            if isinstance(e.get("input"), (bytes, str)):
                return "the request body must be a JSON object (send it with Content-Type: application/json)", None
            return "the request body must be a JSON object holding the request's fields", None
        # Cut the union branch names pydantic puts in the location (e.g. prompt.list[int]).
        path = []
        for p in loc:
            if "[" in p or p in ("str", "int", "float", "bool", "TextPart") or p.startswith("function-"):
                break
            path.append(p)
        name = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path).lstrip(".") or loc[0]
        if path and first_param is None:
            first_param = path[0]
        if name in seen:
            continue
        seen.add(name)
        field = path[-1] if path else name
        if e.get("type") == "missing":
            parts.append(f"{name} is required")
        elif field in FIELD_SHAPES and len(path) < len(loc):
            parts.append(f"{name} must be {FIELD_SHAPES[field]}")
        else:
            msg = e.get("msg", "is invalid").removeprefix("Value error, ")  # a validator's own words
            got = f" (got {_clip(e['input'])})" if "input" in e and not isinstance(e["input"], (dict, list)) else ""
            parts.append(f"{name}: {msg[0].lower() + msg[1:]}{got}")
    return "; ".join(parts[:5]) + (f"; and {len(parts) - 5} more" if len(parts) > 5 else ""), first_param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        messages = {400: "the request body could not be parsed: send UTF-8 encoded JSON, nested less than a "
                         "few hundred levels deep",
                    404: f"no route {request.url.path}; see /v1/completions, /v1/chat/completions, /v1/models",
                    405: f"method {request.method} is not allowed on {request.url.path}"}
        message = messages.get(exc.status_code) or (exc.detail if isinstance(exc.detail, str) else "request failed")
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, "internal server error; the server log has the details"), status_code=500)
