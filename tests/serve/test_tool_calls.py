"""Tool calls: the parsers (any split of the text gives the same calls), the prompt (tools in the
system message where the chat template can't render them, earlier calls and results in the turns),
and, through the unmodified openai client on the real default model, tool_choice "required" and a
named function (every call's arguments parse and match the function's schema), "auto", and
streamed calls that assemble to the non-streamed message."""
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from lab.structured_schemas import TIME_TOOL, WEATHER_TOOL
from serve.protocol import ChatCompletionRequest
from serve.tool_parser import CallArgs, CallStart, Content, ToolCallParser, assemble, parse_all
from serve.tools import resolve_tool_parser

jsonschema = pytest.importorskip("jsonschema")  # the test extra; the GPU hosts lack it

TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

TEXTS = [
    ("hermes", ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", '
                '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
                '"UTC"}}\n</tool_call>\n')),
    ("hermes", "no call here, only < tool_call> talk and a cut tag <tool_ca"),
    ("hermes", '<tool_call>\n{"arguments": {"a": [1, {"b": 2}]}, "name": "f"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": '),
    ("hermes", '<tool_call>\n{"name": "f", "argu'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "g", "parameters": {}}'),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}'),
    ("llama3_json", 'Hello {"name": "f"}'),
    ("hermes", '<tool_call>\n{"arguments": {"text": "' + "x" * 400 + '"}, "name": "f"}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"timezone": "UTC"}}]'),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": [1, {"b": "]"}]}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa}ris"}[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}'),
    ("mistral", "no calls, only [TOOL_CALLS talk and [TOOL_CALLS] not a call"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "argu'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1'),
    ("qwen3_coder", 'Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis "x"\n</parameter>\n'
                    '<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=write>\n'
                    '<parameter=text>\nline 1\n<b>2</b>\n\n</parameter>\n</function>\n</tool_call>'),
    ("qwen3_coder", '<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=flags>\n{"a": [1, 2]}\n'
                    '</parameter>\n<parameter=s>\n007\n</parameter>\n</function>\n</tool_call>'),
    ("qwen3_coder", '<tool_call>\n<function=ping>\n</function>\n</tool_call> and <tool_call>\n{"name": "f", "arguments": '
                    '{"a": 1}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_wea"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nhal"),
    ("qwen3_coder", "a <function=f> outside the tags, and <tool_call> <funct"),
]


@pytest.mark.parametrize("fmt,text", TEXTS)
def test_any_split_gives_the_same_calls(fmt, text):
    whole = parse_all(text, fmt)
    rng = random.Random(len(text))
    for _ in range(50):
        parser, events, i = ToolCallParser(fmt), [], 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            events += parser.feed(text[i:j])
            i = j
        assert assemble(events + parser.close()) == whole


def test_parsed_calls():
    content, calls = parse_all(TEXTS[0][1], "hermes")
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa}ris "x"', "unit": "celsius"}), ("get_time", {"timezone": "UTC"})]
    assert parse_all(TEXTS[2][1], "hermes")[1][0].arguments == '{"a": [1, {"b": 2}]}'  # other key order
    assert parse_all(TEXTS[3][1], "hermes")[1][0].arguments == '{"a": [1, {"b": '  # cut off: as streamed
    assert parse_all(TEXTS[4][1], "hermes") == ('<tool_call>{"name": "f", "argu', [])  # cut before its name
    assert [c.name for c in parse_all(TEXTS[5][1], "llama3_json")[1]] == ["get_weather", "g"]
    assert parse_all(TEXTS[7][1], "llama3_json") == (TEXTS[7][1], [])
    assert parse_all(TEXTS[8][1], "hermes")[1][0].arguments == '{"text": "' + "x" * 400 + '"}'  # parsed whole


def test_qwen3_coder_calls():
    content, calls = parse_all(TEXTS[15][1], "qwen3_coder")
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris "x"', "unit": "celsius"}), ("write", {"text": "line 1\n<b>2</b>\n"})]
    # values typed by the function's schema; one that does not parse as its type stays text
    parser = ToolCallParser("qwen3_coder", {"f": {"n": "integer", "flags": "object", "s": "string"}})
    _, calls = assemble(parser.feed(TEXTS[16][1]) + parser.close())
    assert json.loads(calls[0].arguments) == {"n": 42, "flags": {"a": [1, 2]}, "s": "007"}
    content, calls = parse_all(TEXTS[17][1], "qwen3_coder")  # no parameters; a JSON call between the tags
    assert content == "and " and [(c.name, c.arguments) for c in calls] == [("ping", "{}"), ("f", '{"a": 1}')]
    assert parse_all(TEXTS[18][1], "qwen3_coder") == ("<tool_call><function=get_wea", [])  # cut before its name
    assert [(c.name, c.arguments) for c in parse_all(TEXTS[19][1], "qwen3_coder")[1]] == [("f", "")]  # as streamed
    assert parse_all(TEXTS[20][1], "qwen3_coder")[1] == []


def test_mistral_calls():
    content, calls = parse_all(TEXTS[9][1], "mistral")  # a list of calls (v0.3 templates)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "UTC"})]
    content, calls = parse_all(TEXTS[10][1], "mistral")
    assert content == "Sure. " and calls[0].arguments == '{"a": [1, {"b": "]"}]}'
    content, calls = parse_all(TEXTS[11][1], "mistral")  # name[ARGS]{...} (v11 templates)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Pa}ris"}'), ("get_time", '{"timezone": "UTC"}')]
    assert parse_all(TEXTS[12][1], "mistral") == (TEXTS[12][1], [])  # not calls: content as written
    assert parse_all(TEXTS[13][1], "mistral") == (TEXTS[13][1], [])  # cut before its name
    assert [(c.name, c.arguments) for c in parse_all(TEXTS[14][1], "mistral")[1]] == [("f", '{"a": 1')]  # as streamed


def test_stream_events_shape():
    parser = ToolCallParser("hermes")
    events = parser.feed('<tool_call>\n{"name": "get_time", "arguments": {"time') + parser.feed('zone": "UTC"}}')
    assert isinstance(events[0], CallStart) and events[0].name == "get_time"
    assert all(isinstance(e, CallArgs) for e in events[1:])
    assert not [e for e in parser.feed("\n</tool_call>") + parser.close() if isinstance(e, Content)]


def test_parser_from_the_template():
    assert resolve_tool_parser("auto", "{{ '<|start_header_id|>' }} <|python_tag|> ...") == "llama3_json"
    assert resolve_tool_parser("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert resolve_tool_parser("auto", None) == "hermes"
    assert resolve_tool_parser("auto", "{{ '[TOOL_CALLS]' }}[ARGS]") == "mistral"
    assert resolve_tool_parser("auto", "<tool_call>\n<function={{ name }}>") == "qwen3_coder"
    assert resolve_tool_parser("llama3_json", "<tool_call>") == "llama3_json"


def _planner(model_dir, template=None):
    from transformers import AutoTokenizer

    from serve.prompts import RequestPlanner
    from serve.server_config import ServerConfig

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if template is not None:
        tok.chat_template = template
    return tok, RequestPlanner(tok, 384, 4096, ServerConfig())


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def test_prompt_without_template_tools(model_dir):
    """The test template knows nothing of tools: they go in a system message, the earlier call and its
    result into the turns, Hermes-style."""
    tok, planner = _planner(model_dir)
    plan = planner.chat(ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS}))
    text = tok.decode(plan.prompts[0].token_ids)
    assert text.startswith("<|im_start|>system\n# Tools") and "<tools>" in text
    assert json.dumps(WEATHER_TOOL) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\n18 C\n</tool_response>" in text
    assert plan.tool_parser == "hermes" and plan.params[0].grammar is None  # auto: parsed, not constrained
    plan = planner.chat(ChatCompletionRequest.model_validate({"messages": HISTORY[:1], "tools": TOOLS,
                                                              "tool_choice": "none"}))
    assert "<tools>" not in tok.decode(plan.prompts[0].token_ids) and plan.tool_parser is None


def test_prompt_with_template_tools(model_dir):
    template = ("{% if tools %}TOOLS={{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% for m in messages %}{{ m['role'] }}:{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}"
                "{{ m.tool_calls[0].function.arguments.city }}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")
    tok, planner = _planner(model_dir, template)
    plan = planner.chat(ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS,
                                                              "tool_choice": "required"}))
    text = tok.decode(plan.prompts[0].token_ids)
    assert text.startswith("TOOLS=get_weather,get_time\n") and "# Tools" not in text
    assert "assistant:get_weatherParis" in text  # the arguments reach the template as an object
    assert plan.params[0].grammar is not None


# -- the default model -----------------------------------------------------------------------------

QUESTIONS = ["What's the weather in Paris?", "What time is it in Tokyo?", "Is it raining in London right now?",
             "Tell me the current time in New York.", "How warm is it in Cairo, in fahrenheit?",
             "What is the weather like in Sydney?"]


def check_calls(message, names=None):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def ask(client, question, **kw):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": question}], tools=TOOLS,
                                          max_tokens=120, temperature=0, **kw)


def test_required_calls_are_valid(default_client):
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        responses = list(pool.map(lambda q: ask(default_client, q, tool_choice="required"), QUESTIONS))
    for r in responses:
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content is None
        check_calls(r.choices[0].message)


def test_named_function(default_client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for q in QUESTIONS[:2]:
        r = ask(default_client, q, tool_choice=choice)
        check_calls(r.choices[0].message, ["get_time"])
        assert len(r.choices[0].message.tool_calls) == 1  # a named function: one call


def test_streamed_calls_assemble_to_the_message(default_client):
    for q in QUESTIONS[1:2]:
        whole = ask(default_client, q, tool_choice="required").choices[0]
        calls: dict[int, dict] = {}
        content, reason = "", None
        for chunk in ask(default_client, q, tool_choice="required", stream=True):
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: its id, type and name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
        assert reason == whole.finish_reason == "tool_calls"
        assert content == (whole.message.content or "")
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls]


def test_auto_and_history(default_client):
    r = ask(default_client, QUESTIONS[0])  # auto: the model decides; either way the message is well formed
    m = r.choices[0].message
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in m.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert m.content
    r = default_client.chat.completions.create(model=None, messages=HISTORY, tools=TOOLS, max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
