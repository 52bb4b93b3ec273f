"""OpenAI's Responses API (POST /v1/responses) through the unmodified openai client: the same tokens
as the chat request it stands for, streamed events that assemble to the response, conversations
continued with previous_response_id, the store (also across API processes' folders), tool calls and
structured output on the real default model, the thinking as a reasoning item, and a 400 that names
the field for what it can't serve."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from lab.structured_schemas import NESTED_SCHEMA, TIME_TOOL, WEATHER_TOOL
from serve.responses import ResponseStore
from serve.server_config import ServerConfig
from tests.serve.helpers import ServerThread, build

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def chat(client, messages, n=8, **kw):
    return client.chat.completions.create(model=None, messages=messages, max_tokens=n, **GREEDY, **kw)


def respond(client, n=8, **kw):
    return client.responses.create(model=None, max_output_tokens=n, **GREEDY, **kw)


def events_of(client, n=8, ignore_eos=True, **kw):
    with client.responses.stream(model=None, max_output_tokens=n, temperature=0,
                                 extra_body={"ignore_eos": ignore_eos}, **kw) as s:
        return list(s)


def check_event_order(events):
    """Sequence numbers count up from 0; every item opens before its deltas and closes once, in output order."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    opened, closed = [], []
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(opened) and opened == closed
            opened.append(e.item.id)
        elif e.type == "response.output_item.done":
            assert e.item.id == opened[-1] and e.output_index == len(closed)
            closed.append(e.item.id)
        elif hasattr(e, "item_id"):
            assert e.item_id == opened[-1] and len(closed) == len(opened) - 1, e
    assert opened == closed == [item.id for item in events[-1].response.output]


def test_a_response_is_the_chat_completion_of_its_messages(client):
    r = respond(client, instructions="Answer briefly.", input="The capital of France")
    c = chat(client, [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": "The capital of France"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == c.model
    assert r.output_text == c.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 8 tokens, ignore_eos
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 8 and r.temperature == 0
    # items in place of the string, as clients send them: the same prompt
    items = respond(client, instructions="Answer briefly.",
                    input=[{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                            "text": "The capital of France"}]}])
    assert items.output_text == r.output_text and items.usage.input_tokens == r.usage.input_tokens


def test_streamed_events_assemble_to_the_response(client):
    whole = respond(client, input="Once upon a time", n=12)
    events = events_of(client, input="Once upon a time", n=12)
    check_event_order(events)
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    done = [e.text for e in events if e.type == "response.output_text.done"]
    assert "".join(deltas) == done[0] == final.response.output_text == whole.output_text
    assert final.response.usage.output_tokens == whole.usage.output_tokens == 12
    assert final.response.id == events[0].response.id
    stored = client.responses.retrieve(final.response.id)  # a streamed response is stored as it ends
    assert stored.output_text == whole.output_text and stored.status == "incomplete"


def test_a_conversation_continues_from_the_stored_response(client):
    first = respond(client, instructions="Be terse.", input="Hello there")
    second = respond(client, input="And the next line", previous_response_id=first.id)
    # the chat request it stands for: the first turn and its answer, without the first's instructions
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And the next line"}]
    c = chat(client, messages)
    assert second.previous_response_id == first.id
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens
    # streamed, continued from the streamed one's id: the same
    events = events_of(client, input="And the next line", previous_response_id=first.id)
    assert events[-1].response.output_text == second.output_text


def test_the_store(client, server):
    kept = respond(client, input="Hi")
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unstored = respond(client, input="Hi", store=False)
    for rid in (unstored.id, "resp_" + "0" * 32, "../../etc/passwd"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError) as e:
        respond(client, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    r = httpx.delete(f"{server.base_url}/v1/responses/{kept.id}")
    assert r.status_code == 200 and r.json() == {"id": kept.id, "object": "response", "deleted": True}
    assert httpx.delete(f"{server.base_url}/v1/responses/{kept.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_the_store_is_shared_by_folder_and_bounded(tmp_path):
    """Two API processes' stores on one folder: each reads what the other wrote; each keeps its last `limit`."""
    a, b = ResponseStore(str(tmp_path), limit=2), ResponseStore(str(tmp_path), limit=2)
    ids = [f"resp_{i:032x}" for i in range(3)]
    for rid in ids:
        a.put({"id": rid, "output": []}, [{"type": "message", "role": "user", "content": []}])
    assert b.get(ids[0]) is None and b.get(ids[2])[0]["id"] == ids[2]  # the oldest went
    assert b.delete(ids[1]) and a.get(ids[1]) is None and not a.delete(ids[1])
    big = ResponseStore(str(tmp_path), max_bytes=1200)
    for rid in ids:
        big.put({"id": rid, "output": []}, [{"text": "x" * 400}])
    assert [a.get(rid) is not None for rid in ids] == [False, True, True]  # ~500 bytes each: two fit
    a.close()  # a shared folder is the server's to remove
    assert tmp_path.exists()
    own = ResponseStore()
    own.put({"id": ids[0]}, [])
    own.close()
    assert not own.folder.exists()


def test_function_call_items_and_outputs_make_the_chat_turns(client):
    """An earlier call and its result, as items, render as the chat turns with tool_calls and a tool message."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "unit": "celsius"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
             {"type": "reasoning", "id": "rs_1", "summary": []}]  # earlier thinking stays out of the prompt
    r = respond(client, input=items, tools=[tool], tool_choice="none")
    messages = [items[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": items[1]["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    c = chat(client, messages, tools=[WEATHER_TOOL], tool_choice="none")
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens


def test_truncation_auto_drops_the_oldest_turns(client):
    """The tiny model's context is 512 tokens: three long turns and a short question do not fit;
    "auto" drops turns from the start until they do, and answers as chat does the turns left."""
    long = " ".join(["many words here"] * 40)
    turns = [{"role": "user", "content": f"{i}: {long}"} for i in range(3)]
    turns[1] = {"role": "assistant", "content": long}
    items = turns + [{"role": "user", "content": "And now?"}]
    with pytest.raises(openai.BadRequestError, match="context length"):
        respond(client, input=items)
    r = respond(client, input=items, truncation="auto")
    assert r.truncation == "auto" and r.status == "incomplete"
    # the first turn goes, then the assistant's that would lead: the last user turn (430 tokens) and the question
    c = chat(client, items[2:])
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.output_text == c.choices[0].message.content


def test_logprobs(client):
    r = respond(client, input="Hello", include=["message.output_text.logprobs"], top_logprobs=2)
    c = chat(client, [{"role": "user", "content": "Hello"}], logprobs=True, top_logprobs=2)
    got = r.output[0].content[0].logprobs
    want = c.choices[0].logprobs.content
    # the same tokens; the logprobs within float32 noise (the two ran in different batches)
    assert [(g.token, len(g.top_logprobs)) for g in got] == [(w.token, 2) for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    events = events_of(client, input="Hello", include=["message.output_text.logprobs"], top_logprobs=2)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [w.token for w in want]
    assert [lp.logprob for lp in streamed] == pytest.approx([w.logprob for w in want], abs=1e-4)


@pytest.mark.parametrize("fields,param,says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "text-only"),
    ({"input": []}, "input", "empty"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "previous_response_id"),
    ({"input": [{"type": "function_call", "call_id": 3, "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     "string"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0]", "role"),
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "tools", "function tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools", "letters"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "function"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": "hi", "n": 2}, "n", "one response"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x " * 5000}, "input", "context length"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id", "no stored response"),
    ({"input": "hi", "model": "other-model"}, "model", "not served"),
])
def test_what_it_cannot_serve_is_a_clear_error(server, fields, param, says):
    r = httpx.post(f"{server.base_url}/v1/responses", json=fields, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    server.wait_idle()


def test_the_thinking_is_a_reasoning_item(model_dir):
    """deepseek_r1 with the tiny model, whose output never closes a thinking: a reasoning item holding
    all of it, then an empty message; streamed alike."""
    cfg = ServerConfig(shutdown_timeout_s=1.0, reasoning_parser="deepseek_r1")
    with ServerThread(build(model_dir), cfg) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        c = chat(client, [{"role": "user", "content": "Name a capital."}], n=10)
        r = respond(client, input="Name a capital.", n=10)
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == c.choices[0].message.model_extra["reasoning"]
        assert r.output_text == "" and r.usage.output_tokens_details.reasoning_tokens == 10
        events = events_of(client, input="Name a capital.", n=10)
        check_event_order(events)
        thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thinking == r.output[0].content[0].text
        assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
        with pytest.raises(openai.BadRequestError, match="reasoning parser"):
            respond(client, input="Hi", include=["message.output_text.logprobs"])


# -- the real default model: tool calls and structured output -----------------------------------

TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
          "parameters": t["function"]["parameters"]} for t in (WEATHER_TOOL, TIME_TOOL)]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
QUESTIONS = ["What's the weather in Paris?", "What time is it in Tokyo?", "How warm is it in Cairo, in fahrenheit?"]


def test_required_tool_calls_and_their_results(default_client):
    jsonschema = pytest.importorskip("jsonschema")
    kw = dict(model=None, tools=TOOLS, tool_choice="required", temperature=0, max_output_tokens=120)
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: default_client.responses.create(input=q, **kw), QUESTIONS))
    for r in answers:
        calls = [item for item in r.output if item.type == "function_call"]
        assert calls and r.status == "completed" and not r.output_text
        for call in calls:
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # streamed: the same calls, argument text by argument text
    events = events_of(default_client, n=120, ignore_eos=False, input=QUESTIONS[1], tools=TOOLS, tool_choice="required")
    check_event_order(events)
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [
        (c.name, c.arguments) for c in answers[1].output if c.type == "function_call"]
    for c in streamed:
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == c.id]
        assert "".join(deltas) == c.arguments
    # the application runs the call and sends its result back: the model answers in text
    call = next(i for i in answers[0].output if i.type == "function_call")
    follow = default_client.responses.create(
        model=None, previous_response_id=answers[0].id, tools=TOOLS, temperature=0, max_output_tokens=40,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output
    named = default_client.responses.create(input=QUESTIONS[0], **{**kw, "tool_choice": {"type": "function",
                                                                                          "name": "get_time"}})
    assert [i.name for i in named.output if i.type == "function_call"] == ["get_time"]


def test_json_schema_output(default_client):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": NESTED_SCHEMA, "strict": True}}
    r = default_client.responses.create(model=None, input="Describe a person as JSON.", text=fmt, temperature=0,
                                        max_output_tokens=300)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), NESTED_SCHEMA)


def test_items_come_in_the_order_the_model_wrote_them():
    """Text, a tool call, more text: a message, the call and a second message, in the whole response
    as in the streamed one (whose items open in order), whatever the chunks the text came in."""
    from scheduler.request import SamplingParams, StepOutput
    from serve.openai_format import ChoiceState
    from serve.prompts import Plan, PromptInput
    from serve.responses_format import ResponsesFormat

    text = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\nDone.'
    plan = Plan([PromptInput([1, 2, 3])], [SamplingParams(max_tokens=50)], tool_parser="hermes")
    whole = ResponsesFormat(plan, {}, "m", None).final(ChoiceState(0, 3, text=text, finish_reason="stop"))
    shape = [(i.type, i.content[0].text if i.type == "message" else (i.name, i.arguments)) for i in whole.output]
    assert shape == [("message", "Let me look.\n"), ("function_call", ("get_time", '{"city": "Oslo"}')),
                     ("message", "Done.")]
    for size in (1, 7, len(text)):
        fmt = ResponsesFormat(plan, {}, "m", None)
        choice = ChoiceState(0, 3)
        for at in range(0, len(text), size):
            last = at + size >= len(text)
            out = StepOutput(0, [5], last, "stop" if last else None, text[at:at + size])
            choice.update(out)
            fmt.step_events(choice, out)
        _, streamed = fmt.end_events(choice)
        assert [(i.type, i.content[0].text if i.type == "message" else (i.name, i.arguments))
                for i in streamed.output] == shape, size
