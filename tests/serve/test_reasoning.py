"""--reasoning-parser (serve/reasoning.py): a reasoning model's thinking split from its answer, the same
for any split of the text, streamed deltas assembling to the message; chat_template_kwargs reach the
template (Qwen3's enable_thinking), and a prompt that closes the thinking makes the output the answer."""
import json
import random
import re

import pytest

from scheduler.request import SamplingParams, StepOutput
from serve.errors import APIError
from serve.openai_format import ChatFormat, new_choices, usage
from serve.prompts import Plan, PromptInput
from serve.protocol import ChatCompletionRequest, TokenizeRequest
from serve.reasoning import ReasoningParser, ReasoningTokens, prompt_opens_thinking, split_reasoning
from tests.serve.test_stream_format import check
from tests.serve.test_tool_calls import _planner

CASES = [  # (parser, prompt left <think> open, output, (reasoning, content))
    ("qwen3", False, "<think>\nLet me think.\n</think>\n\nParis.", ("\nLet me think.\n", "\n\nParis.")),
    ("qwen3", False, "Paris.", ("", "Paris.")),
    ("qwen3", False, "  <think>a</think>b", ("a", "b")),
    ("qwen3", True, "hmm </thi</think>Paris <think>x", ("hmm </thi", "Paris <think>x")),
    ("qwen3", False, "<thin", ("", "<thin")),
    ("qwen3", False, "<think>cut off", ("cut off", "")),
    ("deepseek_r1", True, "reason</think>answer", ("reason", "answer")),
    ("deepseek_r1", False, "<think>reason</think>answer", ("reason", "answer")),
    ("deepseek_r1", False, "never closed", ("never closed", "")),
    ("deepseek_r1", True, "", ("", "")),
    ("mistral", False, "[THINK]Let me think.[/THINK]Paris.", ("Let me think.", "Paris.")),
    ("mistral", False, "Paris <think>x</think>", ("", "Paris <think>x</think>")),
    ("mistral", False, "[THI", ("", "[THI")),
    ("mistral", True, "a [/THIN[/THINK]b", ("a [/THIN", "b")),
]


@pytest.mark.parametrize("kind, opened, text, want", CASES)
def test_any_split_gives_the_same_parts(kind, opened, text, want):
    assert split_reasoning(kind, opened, text) == want
    for seed in range(40):
        rng = random.Random(seed)
        parser = ReasoningParser(kind, opened)
        reasoning = content = ""
        i = 0
        while i < len(text):
            j = i + rng.randrange(1, 5)
            r, c = parser.feed(text[i:j])
            reasoning, content, i = reasoning + r, content + c, j
        r, c = parser.close()
        assert (reasoning + r, content + c) == want


@pytest.mark.parametrize("kind, opened, tokens, want", [
    # one token a step: a tag split over tokens counts whole, the answer's tokens do not
    ("qwen3", False, ["<th", "ink>", "The user", " wants", " </thi", "nk>", "\n\n", "Sunny"], 6),
    ("qwen3", False, ["<think>", "a", "</think>", "b", "<think>", "c"], 3),
    ("qwen3", False, ["Paris", "."], 0),
    ("qwen3", True, ["hmm", "</think>", "Paris"], 2),
    ("deepseek_r1", False, ["never", " closed"], 2),
    ("deepseek_r1", True, ["reason", "</think>", "answer"], 2),
])
def test_reasoning_tokens_count_the_thinking(kind, opened, tokens, want):
    counter = ReasoningTokens(kind, opened)
    for t in tokens:
        counter.step(t, 1)
    assert counter.count == want
    # a multi-step step that closes the thinking counts whole
    counter = ReasoningTokens(kind, opened)
    counter.step("".join(tokens), len(tokens))
    assert counter.count == (len(tokens) if want else 0)


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningParser("granite", False)


def _plan(**kw) -> Plan:
    return Plan([PromptInput([1, 2, 3])], [SamplingParams(max_tokens=8)], stream=True, **kw)


def _steps(texts, reason="stop"):
    return [[(0, StepOutput(100, [5 + k], k == len(texts) - 1, reason if k == len(texts) - 1 else None, t,
                            num_prompt_tokens=3, num_output_tokens=k + 1))] for k, t in enumerate(texts)]


@pytest.mark.parametrize("tools", [False, True])
def test_streamed_deltas_assemble_to_the_message(strings, tools):
    texts = ["<th", "ink>", "The user", " wants", " </thi", "nk>", "\n\n", "Sunny", " today."]
    if tools:
        texts += [" <tool_call>", '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "</tool_call>"]
    plan = _plan(reasoning_parser="qwen3", tool_parser="hermes" if tools else None)
    call_ids = re.compile(r'"call_[0-9a-f]{24}"')
    writes = check(plan, _steps(texts), lambda p: ChatFormat(p, "m", strings), lambda s: call_ids.sub('"id"', s))
    events = [json.loads(e[6:]) for e in b"".join(writes).decode().split("\n\n") if e.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "The user wants "
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    choices = new_choices(plan)
    for step in _steps(texts):
        choices[0].update(step[0][1])
    u = usage(plan, choices)
    message = ChatFormat(plan, "m", strings).response(choices, u).choices[0].message
    assert message.reasoning == message.reasoning_content == "The user wants "
    assert u.completion_tokens_details.reasoning_tokens == 6  # <th, ink>, The user, wants, </thi, nk>
    streamed = "".join(d.get("content") or "" for d in deltas)
    assert streamed == message.content
    assert message.content.startswith("\n\nSunny today.")
    if tools:
        assert message.tool_calls[0].function.name == "get_weather"
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        assert "tool_calls" not in message.model_dump() and "reasoning" in message.model_dump()


def test_no_parser_no_reasoning_fields(strings):
    plan = _plan()
    choices = new_choices(plan)
    for step in _steps(["<think>x</think>y"]):
        choices[0].update(step[0][1])
    response = ChatFormat(plan, "m", strings).response(choices, usage(plan, choices))
    assert response.choices[0].message.model_dump() == {"role": "assistant", "content": "<think>x</think>y"}
    assert "completion_tokens_details" not in response.model_dump()["usage"]


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")


def test_chat_template_kwargs_reach_the_template(model_dir):
    from serve.prompts import RequestPlanner
    from serve.server_config import ServerConfig

    tok, _ = _planner(model_dir, QWEN3_LIKE)
    planner = RequestPlanner(tok, 384, 4096, ServerConfig(reasoning_parser="qwen3"))
    messages = [{"role": "user", "content": "hi"}]
    on = planner.chat(ChatCompletionRequest.model_validate({"messages": messages}))
    off = planner.chat(ChatCompletionRequest.model_validate({"messages": messages,
                                                             "chat_template_kwargs": {"enable_thinking": False}}))
    assert tok.decode(off.prompts[0].token_ids).endswith("<think>\n\n</think>\n\n")
    assert not tok.decode(on.prompts[0].token_ids).endswith("</think>\n\n")
    assert on.reasoning_parser == off.reasoning_parser == "qwen3" and not on.thinking_opened
    ids = planner.tokenize(TokenizeRequest.model_validate({"messages": messages,
                                                           "chat_template_kwargs": {"enable_thinking": False}}))
    assert ids == off.prompts[0].token_ids
    with pytest.raises(APIError, match="add_generation_prompt is set by the request"):
        planner.chat(ChatCompletionRequest.model_validate({"messages": messages,
                                                           "chat_template_kwargs": {"add_generation_prompt": False}}))
    without = RequestPlanner(tok, 384, 4096, ServerConfig()).chat(ChatCompletionRequest.model_validate({"messages": messages}))
    assert without.reasoning_parser is None


def test_server_config_checks_the_parser():
    from serve.server_config import ServerConfig

    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="nope")


def test_served_through_the_openai_client(model_dir):
    """deepseek_r1 over HTTP with the tiny model, whose output never closes a thinking: all of it is
    reasoning, streamed or not, and the content is empty."""
    import openai

    from serve.llm import LLM
    from serve.server_config import ServerConfig
    from tests.serve.helpers import ServerThread, build, engine_config

    messages = [{"role": "user", "content": "Name a capital."}]
    offline = LLM.from_config(engine_config(model_dir))
    want = offline.generate([offline.chat_prompt(messages)],
                            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].text
    with ServerThread(build(model_dir), ServerConfig(shutdown_timeout_s=1.0, reasoning_parser="deepseek_r1")) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        kw = dict(model=srv.state.model_name, messages=messages, max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == want
        assert message.content == ""
        assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 10
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 10


@pytest.fixture(scope="module")
def thinking_model(model_dir, tmp_path_factory):
    """The tiny model with `<think>` and `</think>` as tokens of its vocabulary (plain added tokens, as
    Qwen3's are: they stay in the text)."""
    import shutil

    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("thinking") / "llama"
    shutil.copytree(model_dir, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(str(out))
    return out


DIGIT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
         "additionalProperties": False}


def test_structured_output_holds_after_the_thinking(thinking_model):
    from transformers import AutoTokenizer

    from serve.prompts import RequestPlanner
    from serve.reasoning import think_token_ids
    from serve.server_config import ServerConfig

    tok = AutoTokenizer.from_pretrained(str(thinking_model))
    open_id, close_id = think_token_ids(tok)
    assert open_id < 384 and close_id < 384
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": DIGIT}}}
    tok.chat_template = QWEN3_LIKE
    plan = RequestPlanner(tok, 384, 4096, ServerConfig(reasoning_parser="qwen3")).chat(ChatCompletionRequest.model_validate(body))
    grammar = plan.params[0].grammar
    assert f"(<[{open_id}]> THOUGHT <[{close_id}]>)?" in grammar
    assert [g for g, _, need in plan.grammars if need] == [grammar]
    off = RequestPlanner(tok, 384, 4096, ServerConfig(reasoning_parser="qwen3")).chat(
        ChatCompletionRequest.model_validate({**body, "chat_template_kwargs": {"enable_thinking": False}}))
    assert "THOUGHT" not in off.params[0].grammar  # the template closed the thinking: the answer starts at once
    plain = RequestPlanner(tok, 384, 4096, ServerConfig()).chat(ChatCompletionRequest.model_validate(body))
    assert "THOUGHT" not in plain.params[0].grammar


def test_mistral_keeps_its_tags_and_holds_the_grammar_after_them(model_dir):
    """Magistral's [THINK] and [/THINK] are special tokens: the request keeps them in its text, and
    structured output holds from [/THINK], the thinking opened only by [THINK]."""
    from transformers import AutoTokenizer

    from serve.prompts import RequestPlanner
    from serve.reasoning import think_token_ids
    from serve.server_config import ServerConfig

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    open_id, close_id = think_token_ids(tok, "mistral")
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": DIGIT}}}
    plan = RequestPlanner(tok, len(tok), 4096, ServerConfig(reasoning_parser="mistral")).chat(
        ChatCompletionRequest.model_validate(body))
    assert plan.reasoning_parser == "mistral" and plan.params[0].skip_special_tokens is False
    assert f"(<[{open_id}]> THOUGHT <[{close_id}]>)?" in plan.params[0].grammar
    qwen = RequestPlanner(tok, len(tok), 4096, ServerConfig(reasoning_parser="qwen3")).chat(
        ChatCompletionRequest.model_validate({"messages": body["messages"]}))
    assert qwen.params[0].skip_special_tokens is True


@pytest.mark.parametrize("kind, opened", [("qwen3", False), ("deepseek_r1", True), ("deepseek_r1", False)])
def test_the_engine_thinks_then_answers_in_the_schema(thinking_model, kind, opened):
    """The composed grammar in the engine, as the planner composes it: the thinking (its tags pushed by
    a bias so the random model gets there), then JSON in the schema, then the end; the reasoning
    parser then finds the JSON as the content."""
    from engine.grammar import after_thinking, json_schema_grammar
    from serve.llm import LLM
    from serve.reasoning import think_token_ids

    llm = LLM(str(thinking_model), dtype="float32", device="cpu")
    open_id, close_id = think_token_ids(llm.tokenizer)
    grammar = after_thinking(json_schema_grammar(DIGIT), close_id, None if opened else open_id,
                             must_open=kind == "qwen3")
    params = SamplingParams(max_tokens=40, temperature=0, grammar=grammar, logit_bias={open_id: 8.0, close_id: 8.0})
    for out in llm.generate([[5, 9, 33, 70], [101, 7, 7]], params):
        assert close_id in out.token_ids and out.finish_reason == "stop", out
        reasoning, content = split_reasoning(kind, opened, out.text)
        assert 0 <= json.loads(content)["a"] <= 9 and "think>" not in reasoning + content
