"""Engine outputs -> the Responses API's response object and its stream of events.

A response's output is a list of items: the thinking (a reasoning item, with --reasoning-parser),
the answer (a message with one output_text part) and the tool calls (function_call items). Streamed,
each item opens (response.output_item.added), grows by deltas and closes (.done events) in order,
between response.created / response.in_progress and response.completed (response.incomplete when
max_output_tokens cut it, response.failed when the engine failed it); every event carries a
sequence_number, and the last one the whole response. Items come in the order the model wrote
them, whole or streamed: text after a tool call is a message item of its own after the call.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from scheduler.loop import RequestStream
from scheduler.request import StepOutput
from serve.openai_format import ChoiceState, TokenStrings, new_choices, token_logprobs, tool_call_id, usage
from serve.prompts import Plan
from serve.protocol import ChatTokenLogprob
from serve.reasoning import split_reasoning
from serve.responses import new_id
from serve.responses_protocol import (FunctionCallItem, InputTokensDetails, OutputMessage, OutputText, OutputTokensDetails,
                                      ReasoningItem, ReasoningText, ResponseObject, ResponseUsage)
from serve.tool_parser import CallArgs, CallStart, Content, ParsedCall, ToolCallParser, parse_in_order


def response_usage(plan: Plan, choice: ChoiceState) -> ResponseUsage:
    u = usage(plan, [choice])
    return ResponseUsage(input_tokens=u.prompt_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
                         output_tokens=u.completion_tokens,
                         output_tokens_details=OutputTokensDetails(
                             reasoning_tokens=choice.reasoning.count if choice.reasoning is not None else 0),
                         total_tokens=u.total_tokens)


@dataclass
class _Open:
    """The item being streamed: its kind, place in the output, id and what it has so far."""
    kind: str  # "reasoning", "message" or "function_call"
    index: int
    id: str
    text: str = ""  # reasoning or answer text, or a call's arguments
    name: str = ""
    call_id: str = ""


class ResponsesFormat:
    def __init__(self, plan: Plan, envelope: dict[str, Any], model: str, strings: TokenStrings) -> None:
        """envelope: the request's fields the response echoes (serve/api.py)."""
        self.plan = plan
        self.envelope = envelope
        self.model = model
        self.strings = strings
        self.id = new_id("resp")
        self.created = int(time.time())
        # streaming
        self.seq = 0
        self.items: list[Any] = []  # closed items, in output order
        self.open: _Open | None = None
        self.parser = ToolCallParser(plan.tool_parser, plan.tool_params) if plan.tool_parser is not None else None
        self.logprobs: list[ChatTokenLogprob] = []

    # -- the response object ------------------------------------------------------------------

    def response(self, status: str, output: list[Any], u: ResponseUsage | None = None,
                 error: dict[str, Any] | None = None) -> ResponseObject:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return ResponseObject(id=self.id, created_at=self.created, status=status, error=error,
                              incomplete_details=incomplete, model=self.model, output=output, usage=u,
                              **self.envelope)

    def final(self, choice: ChoiceState) -> ResponseObject:
        """The whole response of a finished choice (not streamed)."""
        status = _status(choice)
        text, reasoning = choice.text, ""
        if self.plan.reasoning_parser is not None:
            reasoning, text = split_reasoning(self.plan.reasoning_parser, self.plan.thinking_opened, text)
        parts: list[str | ParsedCall] = [text] if text else []
        if self.plan.tool_parser is not None:
            parts = parse_in_order(text, self.plan.tool_parser, self.plan.tool_params)
        output: list[Any] = []
        if reasoning:
            output.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=reasoning)], status="completed"))
        # the token logprobs (of the whole text) go with the first message
        logprobs = token_logprobs(self.strings, choice.logprobs) if self.plan.logprobs is not None else None
        if not parts:
            parts = [""]  # an empty answer is still a message
        for part in parts:
            if isinstance(part, str):
                output.append(OutputMessage(id=new_id("msg"), status="completed",
                                            content=[OutputText(text=part, logprobs=logprobs)]))
                logprobs = [] if logprobs is not None else None
            else:
                output.append(FunctionCallItem(id=new_id("fc"), call_id=tool_call_id(self.plan.tool_parser),
                                               name=part.name, arguments=part.arguments, status="completed"))
        if status == "incomplete":  # the item max_output_tokens cut, as when streamed
            output[-1].status = "incomplete"
        return self.response(status, output, response_usage(self.plan, choice))

    # -- the stream ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start_events(self) -> list[str]:
        body = self.response("in_progress", []).model_dump(mode="json")
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def step_events(self, choice: ChoiceState, out: StepOutput) -> list[str]:
        """The events of one step's output (ChoiceState.update ran first)."""
        events: list[str] = []
        text = out.new_text
        if choice.reasoning is not None:
            thinking, text = choice.reasoning.split
            if thinking:
                events += self._grow("reasoning", thinking)
        if self.parser is None:
            if text or (out.logprobs and self.plan.logprobs is not None):
                events += self._grow("message", text, token_logprobs(self.strings, out.logprobs))
            return events
        for e in self.parser.feed(text) + (self.parser.close() if out.finished else []):
            if isinstance(e, Content) and e.text:
                events += self._grow("message", e.text)
            elif isinstance(e, CallStart):
                events += self._close("completed")
                self.open = _Open("function_call", len(self.items), new_id("fc"), name=e.name,
                                  call_id=tool_call_id(self.plan.tool_parser))
                events.append(self._event("response.output_item.added", output_index=self.open.index,
                                          item=self._item(self.open, "in_progress").model_dump(mode="json")))
            elif isinstance(e, CallArgs) and self.open is not None and self.open.kind == "function_call":
                self.open.text += e.text
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open.id,
                                          output_index=self.open.index, delta=e.text))
        return events

    def end_events(self, choice: ChoiceState) -> tuple[list[str], ResponseObject]:
        """The closing events of a finished choice, and the response they end with."""
        status = _status(choice)
        item_status = "incomplete" if status == "incomplete" else "completed"
        events = []
        if not any(item.type in ("message", "function_call") for item in self.items) and (
                self.open is None or self.open.kind == "reasoning"):
            events += self._grow("message", "")  # an empty answer is still a message, as when not streamed
        events += self._close(item_status)
        response = self.response(status, self.items, response_usage(self.plan, choice))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response.model_dump(mode="json")))
        return events, response

    def failed_events(self, message: str) -> tuple[list[str], ResponseObject]:
        response = self.response("failed", self.items, error={"code": "server_error", "message": message})
        return [self._event("response.failed", response=response.model_dump(mode="json"))], response

    def _grow(self, kind: str, text: str, logprobs: list[ChatTokenLogprob] | None = None) -> list[str]:
        """Events that add text to the open item of this kind, opening it first where another is open."""
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._close("completed")
            self.open = _Open(kind, len(self.items), new_id("rs" if kind == "reasoning" else "msg"))
            if kind == "message":
                self.logprobs = []
            events.append(self._event("response.output_item.added", output_index=self.open.index,
                                      item=self._item(self.open, "in_progress", empty=True).model_dump(mode="json")))
            events.append(self._event("response.content_part.added", item_id=self.open.id,
                                      output_index=self.open.index, content_index=0, part=self._part(kind, "")))
        if not text and not logprobs:
            return events
        item = self.open
        item.text += text
        self.logprobs += logprobs or []
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=text))
        else:
            events.append(self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                      content_index=0, delta=text,
                                      logprobs=[lp.model_dump() for lp in logprobs or []]))
        return events

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = dict(item_id=item.id, output_index=item.index)
        if item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **at, content_index=0, text=item.text),
                      self._event("response.content_part.done", **at, content_index=0,
                                  part=self._part("reasoning", item.text))]
        elif item.kind == "message":
            events = [self._event("response.output_text.done", **at, content_index=0, text=item.text,
                                  logprobs=[lp.model_dump() for lp in self.logprobs]),
                      self._event("response.content_part.done", **at, content_index=0,
                                  part=self._part("message", item.text))]
        else:
            events = [self._event("response.function_call_arguments.done", **at, name=item.name,
                                  arguments=item.text)]
        done = self._item(item, status)
        self.items.append(done)
        events.append(self._event("response.output_item.done", output_index=item.index, item=done.model_dump(mode="json")))
        return events

    def _part(self, kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return ReasoningText(text=text).model_dump()
        return OutputText(text=text, logprobs=self.logprobs if self.plan.logprobs is not None else None
                          ).model_dump(mode="json")

    def _item(self, item: _Open, status: str, empty: bool = False) -> Any:
        """The item as the output lists it (empty: as it opens, before its content part)."""
        if item.kind == "reasoning":
            made = ReasoningItem(id=item.id, content=[] if empty else [ReasoningText(text=item.text)], status=status)
        elif item.kind == "message":
            logprobs = self.logprobs if self.plan.logprobs is not None else None
            made = OutputMessage(id=item.id, status=status,
                                 content=[] if empty else [OutputText(text=item.text, logprobs=logprobs)])
        else:
            made = FunctionCallItem(id=item.id, call_id=item.call_id, name=item.name, arguments=item.text, status=status)
        return made


def _status(choice: ChoiceState) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


async def response_events(plan: Plan, stream: RequestStream, fmt: ResponsesFormat,
                          done: Callable[[ResponseObject], None]) -> AsyncIterator[bytes]:
    """The request's server-sent events, one write per batch of outputs; done(response) once it ends
    (completed, incomplete or failed), before the last events go out."""
    choice = new_choices(plan)[0]
    yield "".join(fmt.start_events()).encode()
    events: list[str] = []
    async for batch in stream:
        for _, out in batch:
            choice.update(out)
            if out.error:
                stream.abort()
                failed, response = fmt.failed_events(out.error)
                done(response)
                yield "".join(events + failed).encode()
                return
            events += fmt.step_events(choice, out)
        if events and not stream.done:
            yield "".join(events).encode()
            events = []
    end, response = fmt.end_events(choice)
    done(response)
    yield "".join(events + end).encode()
