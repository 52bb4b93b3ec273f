"""Deliver a RequestStream to the client: as server-sent events, or collected into one response.

Either way the request's sequences are aborted the moment the client goes away, so their KV
blocks are free after the engine's current step.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from scheduler.loop import RequestStream
from serve.errors import APIError, error_body
from serve.openai_format import ChoiceState, Format, new_choices, usage
from serve.prompts import Plan

DONE = "data: [DONE]\n\n"


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def sse_error(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message, code=status))}\n\n"


class EngineStreamingResponse(StreamingResponse):
    """A streaming response that runs on_close however it ends: finished, client gone, or cancelled."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def sse_events(plan: Plan, stream: RequestStream, fmt: Format) -> AsyncIterator[bytes]:
    """The request's server-sent events. The events of one batch of outputs (several choices, or
    steps merged while the client was slow) go out as one write, and the last ones together with
    the usage chunk and [DONE]: the same bytes in fewer sends. A step that only adds text takes
    the format's text_event, without building and serializing the chunk's models."""
    choices = new_choices(plan)
    start = [sse(chunk) for chunk in fmt.start_chunks()]
    if start:
        yield "".join(start).encode()
    plain = fmt.plain_text
    events: list[str] = []
    async for batch in stream:
        for index, out in batch:
            choice = choices[index]
            choice.update(out)
            if out.error:
                stream.abort()
                events += (sse_error(500, out.error), DONE)
                yield "".join(events).encode()
                return
            if plain and out.new_text and not out.finished and not out.logprobs:
                events.append(fmt.text_event(index, out.new_text))
                continue
            chunk = fmt.chunk(choice, out)
            if chunk is not None:
                if plan.continuous_usage:
                    chunk.usage = usage(plan, choices)
                events.append(sse(chunk))
        if events and not stream.done:
            yield (events[0] if len(events) == 1 else "".join(events)).encode()
            events = []
    if plan.include_usage:
        events.append(sse(fmt.usage_chunk(usage(plan, choices))))
    events.append(DONE)
    yield "".join(events).encode()


async def collect(plan: Plan, stream: RequestStream) -> list[ChoiceState]:
    choices = new_choices(plan)
    async for batch in stream:
        for index, out in batch:
            choices[index].update(out)
            if out.error:
                raise APIError(500, out.error, code="generation_failed")
    return choices


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


async def collect_while_connected(request: Request, plan: Plan, stream: RequestStream) -> list[ChoiceState]:
    """collect(), but give up (ClientGone) as soon as the client disconnects."""
    work = asyncio.ensure_future(collect(plan, stream))
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        watch.cancel()
        work.cancel()
