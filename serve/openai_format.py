"""Engine outputs -> OpenAI responses and stream chunks, for /v1/completions and /v1/chat/completions.

A ChoiceState accumulates one choice's outputs; a format turns them into the endpoint's response
and chunk models. Both formats share the driver in serve/streaming.py.
"""
from __future__ import annotations

import secrets
import string
import time
import uuid
from array import array
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # json.dumps(s, ensure_ascii=False) of one string, in C
from typing import Any, Protocol

from pydantic import BaseModel

from scheduler.request import PromptLogprobs, StepOutput, TokenLogprob
from scheduler.token_bytes import token_bytes_table
from serve.prompts import Plan
from serve.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                            ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse,
                            CompletionTokensDetails, Delta, DeltaFunction, DeltaToolCall, FunctionCall, PromptLogprob,
                            PromptLogprobsField, PromptTokensDetails, ToolCall, TopLogprob, Usage)
from serve.reasoning import ReasoningTokens, split_reasoning
from serve.tool_parser import CallArgs, CallStart, Content, ToolCallParser, parse_all


class TokenStrings:
    """The text and exact bytes of single tokens, for logprobs; each id is worked out once.

    A token that holds part of a multi-byte character has no text of its own: its bytes come from
    the tokenizer's byte-level vocabulary, and its text is written "bytes:\\xNN..." as OpenAI does.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes = token_bytes_table(tokenizer, skip_special_tokens=False)  # None: not byte-level
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._work_out(token_id)
        return hit

    def _work_out(self, token_id: int) -> tuple[str, bytes]:
        if self._bytes is None or not 0 <= token_id < len(self._bytes):
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return text, text.encode("utf-8")
        raw = self._bytes[token_id]
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


@dataclass
class ChoiceState:
    index: int
    num_prompt_tokens: int
    text: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # engine entries (scheduler/request.py), with the first token
    shows_output: bool = True  # False: an echo-only choice (max_tokens 0), whose one generated token is dropped
    reasoning: ReasoningTokens | None = None  # with a reasoning parser: its split of the text, its count
    embedding: array | None = None  # an embedding request's pooled hidden state (SamplingParams.pooling)

    def update(self, out: StepOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        if self.shows_output:
            self.text += out.new_text
            self.token_ids += out.new_token_ids
            self.num_output_tokens = out.num_output_tokens or self.num_output_tokens + len(out.new_token_ids)
            self.logprobs.extend(out.logprobs)
            if self.reasoning is not None:
                self.reasoning.step(out.new_text, len(out.new_token_ids), out.finished)
        if out.finished:
            # an echo-only choice stops at its length of 0, whatever ended its unshown token
            echo_only_stop = not self.shows_output and out.finish_reason == "stop"
            self.finish_reason = "length" if echo_only_stop else out.finish_reason
            self.error = out.error


def new_choices(plan: Plan) -> list[ChoiceState]:
    kind = plan.reasoning_parser
    return [ChoiceState(i * plan.n + j, len(p.token_ids), shows_output=not plan.echo_only,
                        reasoning=None if kind is None else ReasoningTokens(kind, plan.thinking_opened))
            for i, p in enumerate(plan.prompts) for j in range(plan.n)]


def usage(plan: Plan, choices: list[ChoiceState]) -> Usage:
    """Prompt tokens count once per prompt, however many choices it has; with a reasoning parser,
    the completion's reasoning tokens as OpenAI's reasoning models report them."""
    prompt = sum(len(p.token_ids) for p in plan.prompts)
    completion = sum(c.num_output_tokens for c in choices)
    cached = sum(c.num_cached_tokens for c in choices[::plan.n])
    details = None
    if plan.reasoning_parser is not None:
        details = CompletionTokensDetails(reasoning_tokens=sum(c.reasoning.count for c in choices if c.reasoning))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), completion_tokens_details=details)


_TEXT_MARK = "\x00text\x00"
ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class TextEvent:
    """The server-sent event of a chunk that only adds text, as the chunk model would serialize it:
    `head + the text as a JSON string + tail`. Cut out of the model's own JSON around a marker text,
    so it follows the model; the marker is searched from the end, after the id and model name."""

    head: str
    tail: str

    @classmethod
    def of(cls, chunk: BaseModel) -> "TextEvent":
        head, mark, tail = f"data: {chunk.model_dump_json()}\n\n".rpartition(encode_basestring(_TEXT_MARK))
        assert mark, "the marker text is not in the chunk"
        return cls(head, tail)

    def __call__(self, text: str) -> str:
        return self.head + encode_basestring(text) + self.tail


class _FormatBase:
    """What the two formats share: token ids where asked, and the text-only chunk's event."""
    plan: Plan
    _text_events: dict[int, TextEvent]  # by choice index

    def _ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self.plan.return_token_ids else None

    def _text_chunk(self, index: int, text: str) -> BaseModel:
        raise NotImplementedError

    def text_event(self, index: int, text: str) -> str:
        event = self._text_events.get(index)
        if event is None:
            event = self._text_events[index] = TextEvent.of(self._text_chunk(index, _TEXT_MARK))
        return event(text)


class Format(Protocol):
    # True when a step that only adds text (not finished, no logprobs) streams as text_event(): no
    # logprobs, token ids, usage on every chunk or tool calls asked for
    plain_text: bool

    def start_chunks(self) -> list[BaseModel]: ...
    def chunk(self, choice: ChoiceState, out: StepOutput) -> BaseModel | None: ...
    def text_event(self, index: int, text: str) -> str: ...  # the SSE text of chunk() for such a step
    def usage_chunk(self, u: Usage) -> BaseModel: ...
    def response(self, choices: list[ChoiceState], u: Usage) -> BaseModel: ...


def prompt_logprobs_field(plan: Plan, choices: list[ChoiceState], prompt: int, strings: TokenStrings
                          ) -> PromptLogprobsField | None:
    """vLLM's prompt_logprobs of the prompt-th prompt, where the request asked for them: per token
    (None for the first) its own entry (logprob, rank) and the top prompt_logprobs tokens' (rank 1, 2, ...)."""
    k = plan.prompt_logprobs
    if k is None:
        return None
    entries = choices[prompt * plan.n].prompt_logprobs or []
    out: PromptLogprobsField = []
    for j in range(len(plan.prompts[prompt].token_ids)):
        lp = entries[j] if j < len(entries) else None
        if lp is None:
            out.append(None)
            continue
        listed = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=strings(lp.token_id))}
        for rank, (t, v) in enumerate(lp.top[:k], 1):
            listed.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=strings(t)))
        out.append(listed)
    return out


class CompletionFormat(_FormatBase):
    def __init__(self, plan: Plan, model: str, strings: TokenStrings, tokenizer: Any) -> None:
        self.plan = plan
        self.model = model
        self.strings = strings
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.echo_texts = [self._echo_text(p.text, p.token_ids, tokenizer) for p in plan.prompts] if plan.echo else None
        # echo with logprobs: the prompt's tokens lead the logprobs, and a stream's echo waits for them
        self.echo_logprobs = plan.echo and plan.logprobs is not None
        self.plain_text = (plan.logprobs is None and not plan.return_token_ids and not plan.continuous_usage
                           and not plan.echo_only)
        self._text_events = {}

    @staticmethod
    def _echo_text(text: str | None, ids: list[int], tokenizer: Any) -> str:
        return text if text is not None else tokenizer.decode(ids)

    def _prefix(self, index: int) -> str:
        return self.echo_texts[index // self.plan.n] if self.echo_texts else ""

    def _echo_logprobs(self, index: int, entries: PromptLogprobs | None, out: CompletionLogprobs) -> None:
        """Echo's share of a choice's logprobs, into out: each prompt token's (the first has none)."""
        entries = entries or []
        k = self.plan.logprobs or 0
        offset = 0
        for j, token_id in enumerate(self.plan.prompts[index // self.plan.n].token_ids):
            token = self.strings(token_id)
            lp = entries[j] if j < len(entries) else None
            top = None
            if lp is not None:
                top = {self.strings(t): v for t, v in lp.top[:k]}
                top.setdefault(token, lp.logprob)
            out.tokens.append(token)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)

    def _logprobs(self, lps: list[TokenLogprob], offset: int, out: CompletionLogprobs | None = None
                  ) -> CompletionLogprobs:
        out = out or CompletionLogprobs()
        for lp in lps:
            token = self.strings(lp.token_id)
            top = {self.strings(t): v for t, v in lp.top}
            top.setdefault(token, lp.logprob)  # the sampled token is always listed, as OpenAI does
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _response(self, choices: list[CompletionChoice], u: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)

    def start_chunks(self) -> list[BaseModel]:
        if not self.echo_texts or self.echo_logprobs:
            return []
        return [self._response([CompletionChoice(index=i, text=self._prefix(i))], None)
                for i in range(len(self.plan.prompts) * self.plan.n)]

    def chunk(self, choice: ChoiceState, out: StepOutput) -> BaseModel | None:
        shown = choice.shows_output
        text, token_lps, ids = (out.new_text, out.logprobs, out.new_token_ids) if shown else ("", [], [])
        lead = self.echo_logprobs and out.prompt_logprobs is not None  # the echo and its logprobs go first
        if not (text or token_lps or lead or out.finished or (self.plan.return_token_ids and ids)):
            return None  # text held back (a partial character, a possible stop string): nothing to say yet
        lps = None
        if self.plan.logprobs is not None:
            lps = CompletionLogprobs()
            if lead:
                self._echo_logprobs(choice.index, out.prompt_logprobs, lps)
            self._logprobs(token_lps, len(self._prefix(choice.index)) + len(choice.text) - len(text), lps)
        head = self._prefix(choice.index) if lead else ""
        return self._response([CompletionChoice(index=choice.index, text=head + text, logprobs=lps,
                                                finish_reason=out.finish_reason if out.finished else None,
                                                token_ids=self._ids(ids))], None)

    def _text_chunk(self, index: int, text: str) -> BaseModel:
        return self._response([CompletionChoice(index=index, text=text)], None)

    def usage_chunk(self, u: Usage) -> BaseModel:
        return self._response([], u)

    def response(self, choices: list[ChoiceState], u: Usage) -> BaseModel:
        out = []
        for c in choices:
            prefix = self._prefix(c.index)
            lps = None
            if self.plan.logprobs is not None:
                lps = CompletionLogprobs()
                if self.echo_logprobs:
                    self._echo_logprobs(c.index, c.prompt_logprobs, lps)
                self._logprobs(c.logprobs, len(prefix), lps)
            listed = prompt_logprobs_field(self.plan, choices, c.index // self.plan.n, self.strings)
            out.append(CompletionChoice(index=c.index, text=prefix + c.text, logprobs=lps, finish_reason=c.finish_reason,
                                        token_ids=self._ids(c.token_ids), prompt_logprobs=listed))
        return self._response(out, u)


def token_logprobs(strings: TokenStrings, lps: list[TokenLogprob]) -> list[ChatTokenLogprob]:
    """Each token's logprob with its text and bytes, and its top tokens', as chat completions and the
    Responses API's output_text list them."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        token, raw = strings.get(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(raw))

    out = []
    for lp in lps:
        t = top(lp.token_id, lp.logprob)
        out.append(ChatTokenLogprob(token=t.token, logprob=t.logprob, bytes=t.bytes,
                                    top_logprobs=[top(i, v) for i, v in lp.top]))
    return out


def tool_call_id(fmt: str | None = None) -> str:
    """A new call's id: OpenAI's shape, or for mistral the 9 letters and digits its templates insist on."""
    if fmt == "mistral":
        return "".join(secrets.choice(ID_CHARS) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_finish_reason(reason: str | None, num_calls: int) -> str | None:
    """A turn that ends by itself after calling tools ends with "tool_calls", as OpenAI's do."""
    return "tool_calls" if num_calls and reason == "stop" else reason


class ChatFormat(_FormatBase):
    def __init__(self, plan: Plan, model: str, strings: TokenStrings) -> None:
        self.plan = plan
        self.model = model
        self.strings = strings
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.parsers: dict[int, ToolCallParser] = {}  # choice index -> its tool-call parser (streaming)
        self.plain_text = (plan.logprobs is None and not plan.return_token_ids and not plan.continuous_usage
                           and plan.tool_parser is None and plan.reasoning_parser is None)
        self._text_events = {}

    def _logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs | None:
        if self.plan.logprobs is None:
            return None
        return ChatLogprobs(content=token_logprobs(self.strings, lps))

    def _chunk(self, choices: list[ChatChunkChoice], u: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)

    def start_chunks(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
                for i in range(self.plan.n)]

    def chunk(self, choice: ChoiceState, out: StepOutput) -> BaseModel | None:
        if not (out.new_text or out.logprobs or out.finished or (self.plan.return_token_ids and out.new_token_ids)):
            return None
        text, reasoning = self._thinking(choice, out)
        delta, reason = Delta(content=text or None, reasoning=reasoning, reasoning_content=reasoning), out.finish_reason
        if self.plan.tool_parser is not None:
            delta, reason = self._tool_delta(choice.index, text, out)
            delta.reasoning = delta.reasoning_content = reasoning
        if (self.plan.tool_parser is not None or self.plan.reasoning_parser is not None) and (
                delta.content is None and delta.tool_calls is None and reasoning is None and not out.finished
                and not out.logprobs and not self.plan.return_token_ids):
            return None  # text held back: it may begin a tool call, or end the thinking
        return self._chunk([ChatChunkChoice(index=choice.index, delta=delta,
                                            logprobs=self._logprobs(out.logprobs),
                                            finish_reason=reason if out.finished else None,
                                            token_ids=self._ids(out.new_token_ids))])

    def _text_chunk(self, index: int, text: str) -> BaseModel:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(content=text))])

    def _thinking(self, choice: ChoiceState, out: StepOutput) -> tuple[str, str | None]:
        """The step's text as the choice's reasoning parser split it (ChoiceState.update ran first):
        (the answer's text, the thinking's or None)."""
        if choice.reasoning is None:
            return out.new_text, None
        reasoning, text = choice.reasoning.split
        return text, reasoning or None

    def _tool_delta(self, index: int, text: str, out: StepOutput) -> tuple[Delta, str | None]:
        """The step's answer text through the choice's tool-call parser: content, and tool calls in
        OpenAI's stream shape (the first delta of a call: its id, type and name; then argument text)."""
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = ToolCallParser(self.plan.tool_parser, self.plan.tool_params)
        events = parser.feed(text) + (parser.close() if out.finished else [])
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls: list[DeltaToolCall] = []
        for e in events:
            if isinstance(e, CallStart):
                calls.append(DeltaToolCall(index=e.index, id=tool_call_id(self.plan.tool_parser), type="function",
                                           function=DeltaFunction(name=e.name, arguments="")))
            elif isinstance(e, CallArgs):
                if calls and calls[-1].index == e.index:
                    calls[-1].function.arguments = (calls[-1].function.arguments or "") + e.text
                else:
                    calls.append(DeltaToolCall(index=e.index, function=DeltaFunction(arguments=e.text)))
        return Delta(content=content or None, tool_calls=calls or None), chat_finish_reason(out.finish_reason,
                                                                                           parser.num_calls)

    def _message(self, c: ChoiceState) -> tuple[AssistantMessage, str | None]:
        text, reasoning = c.text, None
        if self.plan.reasoning_parser is not None:
            reasoning, text = split_reasoning(self.plan.reasoning_parser, self.plan.thinking_opened, text)
            reasoning = reasoning or None
        if self.plan.tool_parser is None:
            return AssistantMessage(content=text, reasoning=reasoning, reasoning_content=reasoning), c.finish_reason
        content, calls = parse_all(text, self.plan.tool_parser, self.plan.tool_params)
        tool_calls = [ToolCall(id=tool_call_id(self.plan.tool_parser),
                               function=FunctionCall(name=k.name, arguments=k.arguments)) for k in calls]
        message = AssistantMessage(content=content or (None if calls else ""), tool_calls=tool_calls or None,
                                   reasoning=reasoning, reasoning_content=reasoning)
        return message, chat_finish_reason(c.finish_reason, len(calls))

    def usage_chunk(self, u: Usage) -> BaseModel:
        return self._chunk([], u)

    def response(self, choices: list[ChoiceState], u: Usage) -> BaseModel:
        out = []
        for c in choices:
            message, reason = self._message(c)
            out.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.logprobs),
                                  finish_reason=reason, token_ids=self._ids(c.token_ids)))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=u, choices=out,
                                      prompt_logprobs=prompt_logprobs_field(self.plan, choices, 0, self.strings))
