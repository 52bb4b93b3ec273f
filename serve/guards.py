"""ASGI middleware that guards the app before any route runs: the API key and the body size.

Plain ASGI (not Starlette's BaseHTTPMiddleware), so streaming responses and disconnect
notifications pass through untouched.
"""
from __future__ import annotations

import hmac
import json
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import error_body


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGuard:
    """Every path under /v1 needs "Authorization: Bearer <key>"; compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        # compare_digest takes as long for a wrong key as for a right one of the same length
        return hmac.compare_digest(token, self.expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not self.authorized(given):
                await send_error(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over max_bytes with 413 before the app sees them.

    The body is read here, up to the limit, and replayed to the app; after it, receive() is the
    server's own again, so the app still hears of a client that disconnects.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replaying_receive() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replaying_receive, send)

    async def _refuse(self, send: Send) -> None:
        await send_error(send, 413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                         code="request_too_large", headers=[(b"connection", b"close")])

