"""The streamed events of serve/streaming.py's sse_events against the chunk models they stand for:
the fast text event (serve/openai_format.py's TextEvent) must equal the pydantic chunk's JSON for any
text, and a whole stream must be the same bytes as one pydantic chunk per output, each written alone
(what the server sent before the fast path), whatever the batches, choices and options."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from scheduler.loop import OutputStream
from scheduler.request import SamplingParams, StepOutput, TokenLogprob
from serve.openai_format import ChatFormat, CompletionFormat, Format, new_choices, usage
from serve.prompts import Plan, PromptInput
from serve.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, Delta)
from serve.streaming import DONE, sse, sse_error, sse_events

TEXTS = ["Hello", " wörld", ' "quoted" \\ back\\slash', "\n\t\r\x00\x1f\x7f", "東京🚀", "\u2028\u2029", "</script>", " "]


class FedStream(OutputStream):
    """An OutputStream the test feeds; it records the batches it hands out and whether it was aborted."""

    def __init__(self, num_seqs: int) -> None:
        super().__init__(num_seqs)
        self.batches: list[list[tuple[int, StepOutput]]] = []
        self.aborted = False

    async def __anext__(self) -> list[tuple[int, StepOutput]]:
        batch = await super().__anext__()
        self.batches.append(batch)
        return batch

    def abort(self) -> None:
        self.aborted = True


def reference_events(plan: Plan, batches: list[list[tuple[int, StepOutput]]], fmt: Format) -> list[str]:
    """One pydantic chunk per output, as sse_events wrote them before its fast path."""
    choices = new_choices(plan)
    events = [sse(chunk) for chunk in fmt.start_chunks()]
    for batch in batches:
        for index, out in batch:
            choice = choices[index]
            choice.update(out)
            if out.error:
                return events + [sse_error(500, out.error), DONE]
            chunk = fmt.chunk(choice, out)
            if chunk is not None:
                if plan.continuous_usage:
                    chunk.usage = usage(plan, choices)
                events.append(sse(chunk))
    if plan.include_usage:
        events.append(sse(fmt.usage_chunk(usage(plan, choices))))
    return events + [DONE]


def stream_of(plan: Plan, steps: list[list[tuple[int, StepOutput]]], fmt: Format) -> tuple[list[bytes], FedStream]:
    """sse_events' writes while the steps arrive one by one (each a batch of its own, unless the
    test puts several outputs of one choice in a step: those merge)."""
    async def main() -> tuple[list[bytes], FedStream]:
        stream = FedStream(len(plan.prompts) * plan.n)
        writes: list[bytes] = []

        async def consume() -> None:
            async for data in sse_events(plan, stream, fmt):
                assert isinstance(data, bytes)
                writes.append(data)

        task = asyncio.ensure_future(consume())
        for step in steps:
            await asyncio.sleep(0)
            for index, out in step:
                stream._put(index, out)
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.wait_for(task, 5)
        return writes, stream

    return asyncio.run(main())


def plan_of(n: int = 1, prompts: int = 1, **kw) -> Plan:
    return Plan([PromptInput([1, 2, 3], text="ab" if i == 0 else None) for i in range(prompts)],
                [SamplingParams(max_tokens=8)] * n, stream=True, **kw)


def text_steps(n_choices: int, texts: list[str], reason: str = "length", logprobs: bool = False,
               ids: bool = True) -> list[list[tuple[int, StepOutput]]]:
    steps = []
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        lps = [TokenLogprob(5 + k, -0.5 * k, [(5 + k, -0.5 * k), (7, -1.25)])] if logprobs else []
        steps.append([(i, StepOutput(100 + i, [5 + k] if ids else [], last, reason if last else None, text, lps,
                                     num_prompt_tokens=3 if k == 0 else 0, num_output_tokens=k + 1,
                                     num_cached_tokens=2 if k == 0 else 0))
                      for i in range(n_choices)])
    return steps


def same_fmt(make, plan: Plan):
    """Two formats of one request (same id and created): the reference's and the stream's."""
    a, b = make(plan), make(plan)
    b.id, b.created = a.id, a.created
    return a, b


def check(plan: Plan, steps, make, normalize=lambda s: s) -> list[bytes]:
    ref_fmt, fmt = same_fmt(make, plan)
    writes, stream = stream_of(plan, steps, fmt)
    want = "".join(reference_events(plan, stream.batches, ref_fmt))
    assert normalize(b"".join(writes).decode()) == normalize(want)
    for event in want.split("\n\n")[:-2]:  # OpenAI clients parse each event as JSON
        assert event.startswith("data: ") and json.loads(event[6:])
    return writes


def completion(strings):
    return lambda plan: CompletionFormat(plan, 'model "x" é', strings, strings.tokenizer)


def chat(strings):
    return lambda plan: ChatFormat(plan, "model/ü", strings)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("opts", [{}, {"include_usage": True}, {"continuous_usage": True, "include_usage": True},
                                  {"return_token_ids": True}, {"logprobs": 2}])
def test_a_stream_is_the_bytes_of_one_model_chunk_per_output(strings, kind, opts):
    make = completion(strings) if kind == "completion" else chat(strings)
    plan = plan_of(**opts)
    check(plan, text_steps(1, TEXTS, logprobs="logprobs" in opts), make)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_several_choices_and_prompts_write_once_per_batch(strings, kind):
    make = completion(strings) if kind == "completion" else chat(strings)
    plan = plan_of(n=2, prompts=2 if kind == "completion" else 1, include_usage=True)
    steps = text_steps(4 if kind == "completion" else 2, TEXTS[:4])
    writes = check(plan, steps, make)
    assert len(writes) == (1 if kind == "chat" else 0) + len(steps)  # the last with the usage and [DONE]


def test_merged_steps_of_a_slow_client_and_held_back_text(strings):
    plan = plan_of(include_usage=True)
    step = text_steps(1, ["a", "b\n", "c", "d"], reason="stop")
    held = [(0, StepOutput(100, [9], False, None, "", num_output_tokens=2))]  # a partial character: no event
    steps = [step[0], held, step[1] + step[2], step[3]]  # one choice's two steps in one batch: merged
    check(plan, steps, completion(strings))
    check(plan, steps, chat(strings))


def test_echo_and_stop_reason(strings):
    plan = plan_of(echo=True, include_usage=True)
    check(plan, text_steps(1, TEXTS[:3], reason="stop"), completion(strings))


def _events(writes: list[bytes]) -> list[dict]:
    body = b"".join(writes).decode()
    return [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("echo_only", [False, True])
def test_echo_with_logprobs_leads_with_the_prompt(strings, echo_only):
    """Echo with logprobs: no start chunk; the first output brings the echo and the prompt tokens'
    logprobs (the first token's None). Echo only (max_tokens 0): the generated token never shows."""
    plan = plan_of(echo=True, logprobs=1, echo_only=echo_only, include_usage=True)
    steps = text_steps(1, ["X", "Y"], logprobs=True)
    prompt = [None, TokenLogprob(2, -1.5, [(2, -1.5)], 1), TokenLogprob(3, -0.25, [(9, -0.1)], 2)]
    steps[0][0][1].prompt_logprobs = prompt
    events = _events(check(plan, steps, completion(strings)))
    first = events[0]["choices"][0]
    assert first["text"] == "ab" + ("" if echo_only else "X")
    lp = first["logprobs"]
    assert lp["token_logprobs"][:3] == [None, -1.5, -0.25] and lp["top_logprobs"][0] is None
    assert lp["tokens"][:3] == [strings(1), strings(2), strings(3)]
    assert lp["top_logprobs"][2] == {strings(9): -0.1, strings(3): -0.25}
    assert len(lp["tokens"]) == (3 if echo_only else 4)
    texts = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert texts == ("ab" if echo_only else "abXY")
    assert events[-1]["usage"]["completion_tokens"] == (0 if echo_only else 2)


def test_an_error_ends_the_stream_with_its_event_and_aborts(strings):
    plan = plan_of(n=2)
    steps = text_steps(2, TEXTS[:3])
    steps[1] = [steps[1][0], (1, StepOutput(101, [], True, "error", error="the engine failed: \"x\""))]
    for make in (completion(strings), chat(strings)):
        ref_fmt, fmt = same_fmt(make, plan)
        writes, stream = stream_of(plan, steps, fmt)
        assert stream.aborted
        body = b"".join(writes).decode()
        assert body == "".join(reference_events(plan, stream.batches, ref_fmt))
        assert body.endswith(sse_error(500, 'the engine failed: "x"') + DONE)


def test_tool_calls_stream_as_before(strings):
    plan = plan_of(tool_parser="hermes", include_usage=True)
    texts = ["Let me check. ", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Zürich"}}',
             "</tool_call>", ""]
    calls = re.compile(r'"call_[0-9a-f]{24}"')
    writes = check(plan, text_steps(1, texts, reason="stop"), chat(strings), lambda s: calls.sub('"call_id"', s))
    assert b'"tool_calls"' in b"".join(writes)


def test_start_chunks_go_out_before_the_first_token(strings):
    plan = plan_of(n=2)

    async def main() -> list[bytes]:
        stream = FedStream(2)
        events = sse_events(plan, stream, ChatFormat(plan, "m", strings))
        first = await events.__anext__()  # nothing fed yet
        await events.aclose()
        return [first]

    (first,) = asyncio.run(main())
    roles = [json.loads(e[6:]) for e in first.decode().split("\n\n") if e]
    assert [r["choices"][0]["delta"] for r in roles] == [{"role": "assistant", "content": ""}] * 2


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1), model=st.text(), index=st.integers(0, 40))
def test_text_event_is_the_chunk_models_json(text, model, index):
    plan = plan_of()
    comp = CompletionFormat(plan, model, None, None)
    want = CompletionResponse(id=comp.id, created=comp.created, model=model,
                              choices=[CompletionChoice(index=index, text=text)])
    assert comp.text_event(index, text) == sse(want)
    ch = ChatFormat(plan, model, None)
    want = ChatCompletionChunk(id=ch.id, created=ch.created, model=model,
                               choices=[ChatChunkChoice(index=index, delta=Delta(content=text))])
    assert ch.text_event(index, text) == sse(want)


def test_the_fast_path_is_off_where_a_chunk_carries_more_than_text():
    for opts, plain in (({}, True), ({"logprobs": 0}, False), ({"return_token_ids": True}, False),
                        ({"continuous_usage": True}, False)):
        assert CompletionFormat(plan_of(**opts), "m", None, None).plain_text is plain
        assert ChatFormat(plan_of(**opts), "m", None).plain_text is plain
    assert not ChatFormat(plan_of(tool_parser="hermes"), "m", None).plain_text
