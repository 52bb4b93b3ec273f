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

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def sse_events(plan: Plan, stream: RequestStream, fmt: Format) -> AsyncIterator[str]:
    choices = new_choices(plan)
    for chunk in fmt.start_chunks():
        yield sse(chunk)
    async for batch in stream:
        for index, out in batch:
            choice = choices[index]
            choice.update(out)
            if out.error:
                stream.abort()
                yield sse_error(500, out.error)
                yield DONE
                return
            chunk = fmt.chunk(choice, out)
            if chunk is not None:
                if plan.continuous_usage:
                    chunk.usage = usage(plan, choices)
                yield sse(chunk)
    if plan.include_usage:
        yield sse(fmt.usage_chunk(usage(plan, choices)))
    yield DONE


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
