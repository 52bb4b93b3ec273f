"""Bad input: every case is a 4xx in the OpenAI error shape that says what to fix, and the server
keeps serving. Security limits: API key, body size, n, max_tokens."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from serve.server_config import ServerConfig
from tests.serve.helpers import ServerThread, build

LONG = "the quick brown fox " * 400  # far over the 512-token context

# (name, path, body: dict | bytes, expected status, a phrase the message must contain)
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi", ', 400, "not valid JSON"),
    ("json array body", "/v1/completions", b"[1, 2]", 400, "body"),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "invalid Unicode"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt is required"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages is required"),
    ("prompt wrong type", "/v1/completions", {"prompt": 12}, 400, "prompt must be a string"),
    ("prompt mixed list", "/v1/completions", {"prompt": ["a", 1]}, 400, "prompt must be"),
    ("prompt bool ids", "/v1/completions", {"prompt": [True, False]}, 400, "prompt must be"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "empty"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "empty"),
    ("empty token list", "/v1/completions", {"prompt": [[]]}, 400, "empty"),
    ("max_tokens string", "/v1/completions", {"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", "/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("temperature string", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("temperature NaN", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p over one", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("token id too big", "/v1/completions", {"prompt": [1, 2, 99999]}, 400, "outside the vocabulary"),
    ("token id negative", "/v1/completions", {"prompt": [[1, -3]]}, 400, "outside the vocabulary"),
    ("prompt too long", "/v1/completions", {"prompt": LONG}, 400, "context length is 512"),
    ("prompt text far too long", "/v1/completions", {"prompt": "x" * 40000}, 400, "characters"),
    ("many prompts", "/v1/completions", {"prompt": ["a"] * 100000}, 400, "at most 64"),
    ("prompt plus max_tokens too long", "/v1/completions", {"prompt": "hi", "max_tokens": 511}, 400,
     "context length is 512"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("n over limit", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "at most 16"),
    ("too many sequences", "/v1/completions", {"prompt": ["a"] * 20, "n": 4}, 400, "at most 64"),
    ("logprobs over 20", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("max_tokens 0 without echo", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "echo: true"),
    ("max_tokens negative", "/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("prompt_logprobs over 20", "/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt_logprobs streamed", "/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400,
     "cannot be streamed"),
    ("chat prompt_logprobs streamed", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "stream": True}, 400,
     "cannot be streamed"),
    ("stop wrong type", "/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop must be"),
    ("stop empty", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("stop too long", "/v1/completions", {"prompt": "hi", "stop": "x" * 1000}, 400, "at most 128"),
    ("too many stops", "/v1/completions", {"prompt": "hi", "stop": [str(i) for i in range(40)]}, 400, "at most 8"),
    ("stream not bool", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("stream_options wrong", "/v1/completions", {"prompt": "hi", "stream": True, "stream_options": 3}, 400,
     "stream_options"),
    ("penalty out of range", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency penalty string", "/v1/completions", {"prompt": "hi", "frequency_penalty": "x"}, 400,
     "frequency_penalty"),
    ("repetition penalty zero", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("min_p over one", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, 400,
     "min_p"),
    ("min_tokens negative", "/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("min_tokens over max_tokens", "/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400,
     "min_tokens"),
    ("min_tokens with a schema", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "min_tokens": 3, "response_format": {"type": "json_object"}},
     400, "min_tokens"),
    ("logit_bias key", "/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "not a token id"),
    ("logit_bias token", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400,
     "outside the vocabulary"),
    ("logit_bias value", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 150}}, 400, "between -100 and 100"),
    ("tokenize both", "/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "either"),
    ("tokenize nothing", "/tokenize", {}, 400, "either"),
    ("tokenize prompt ids", "/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    ("tokenize continue a user message", "/tokenize",
     {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True, "add_generation_prompt": False},
     400, "assistant"),
    ("detokenize outside", "/detokenize", {"tokens": [1, 99999]}, 400, "outside the vocabulary"),
    ("detokenize text", "/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ("tokenize unknown model", "/tokenize", {"prompt": "hi", "model": "gpt-9"}, 404, "not served here"),
    ("allowed_token_ids empty", "/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400,
     "allowed_token_ids"),
    ("allowed_token_ids outside", "/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 99999]}, 400,
     "outside the vocabulary"),
    ("allowed_token_ids with a schema", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [5],
      "response_format": {"type": "json_object"}}, 400, "allowed_token_ids"),
    ("logit_bias not an object", "/v1/completions", {"prompt": "hi", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("chat echo", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "echo"),
    ("stream_options without stream", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400, "stream: true"),
    ("continue with a generation prompt", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
      "continue_final_message": True}, 400, "add_generation_prompt"),
    ("continue a user message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True, "add_generation_prompt": False},
     400, "assistant"),
    ("seed past int64", "/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("truncate zero", "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "not served here"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("messages empty", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "content"),
    ("chat lone surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "invalid Unicode"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("null content", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "needs content"),
    ("missing content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "needs content"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "logprobs"),
    ("chat prompt too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400,
     "context length is 512"),
]

TRACE_HINTS = re.compile(r"Traceback|File \"|\.py\b|/work/|/tmp/|site-packages|Error\(|line \d+")


def check_error(r: httpx.Response, status: int, phrase: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    msg = body["error"]["message"]
    assert isinstance(msg, str) and phrase.lower() in msg.lower(), msg
    assert not TRACE_HINTS.search(msg), msg
    return body["error"]


@pytest.mark.parametrize("name,path,body,status,phrase", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, path, body, status, phrase):
    if isinstance(body, bytes):
        r = server.http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.http.post(path, json=body)
    check_error(r, status, phrase)


def test_error_fields_and_server_still_serves(server):
    err = check_error(server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}),
                      400, "max_tokens")
    assert err["type"] == "invalid_request_error" and err["param"] == "max_tokens"
    err = check_error(server.http.post("/v1/completions", json={"prompt": LONG}), 400, "tokens")
    assert err["code"] == "context_length_exceeded" and re.search(r"prompt has \d+ tokens", err["message"])
    r = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    server.wait_idle()


def test_vllm_fields_that_ask_for_nothing_are_served(server):
    """repetition_penalty 1, min_p 0 and min_tokens 0 change nothing; they are served as such."""
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0,
            "seed": -2**63}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    server.wait_idle()


def test_odd_but_valid_unicode_is_served(server):
    for prompt in ["naïve café 北京 🚀✨", "\u0000\u200b\ufeff tab\tnew\nline", "\U0001F600" * 20, "\u202e reversed"]:
        r = server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200, r.text
        json.dumps(r.json())
    r = server.http.post("/v1/completions", json={"prompt": "hi", "top_k": 10**12, "seed": 2**63 - 1,
                                                              "max_tokens": 2, "temperature": 1e-30})
    assert r.status_code == 200, r.text


def test_routes_and_methods(server):
    check_error(server.http.get("/v1/nothing"), 404, "no route")
    check_error(server.http.get("/v1/completions"), 405, "not allowed")
    check_error(server.http.post("/v1/completions", content=b'{"prompt": "hi"}',
                           headers={"Content-Type": "text/plain"}), 400, "JSON")


def test_body_over_limit(server):
    big = {"prompt": "x" * (9 * 2**20)}
    check_error(server.http.post("/v1/completions", json=big), 413, "larger than the limit")


@pytest.fixture(scope="module")
def guarded(model_dir):
    cfg = ServerConfig(api_key="s3cret-key", max_body_bytes=2000, max_n=2, max_tokens_limit=20,
                       shutdown_timeout_s=1.0)
    with ServerThread(build(model_dir), cfg) as srv:
        yield srv


def test_api_key_on_every_v1_route(guarded):
    http = guarded.http
    good = {"Authorization": "Bearer s3cret-key"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                    {"Authorization": "Bearer s3cret-keyX"}, {"Authorization": "Bearer  s3cret-key"},
                    {"Authorization": "Basic s3cret-key"}):
        check_error(http.get("/v1/models", headers=headers), 401, "API key")
        check_error(http.post("/v1/completions", json={"prompt": "hi"}, headers=headers), 401, "API key")
        check_error(http.post("/v1/chat/completions", json={}, headers=headers), 401, "API key")
        check_error(http.get("/v1/unknown", headers=headers), 401, "API key")
    assert http.get("/v1/models", headers=good).status_code == 200
    assert http.get("/v1/models", headers={"Authorization": "bearer s3cret-key"}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=good).status_code == 200
    assert http.get("/health").status_code == 200


def test_openai_client_with_api_key(guarded):
    import openai

    c = openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="s3cret-key", max_retries=0)
    assert c.completions.create(model=guarded.state.model_name, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_limits(guarded):
    http, good = guarded.http, {"Authorization": "Bearer s3cret-key"}
    check_error(http.post("/v1/completions", json={"prompt": "x" * 3000}, headers=good), 413, "2000 bytes")

    def chunked():  # no Content-Length: the limit must hold while streaming the body in
        for _ in range(10):
            yield b" " * 500

    check_error(http.post("/v1/completions", content=chunked(),
                           headers={**good, "Content-Type": "application/json"}), 413, "limit")
    check_error(http.post("/v1/completions", json={"prompt": "hi", "n": 3}, headers=good), 400, "at most 2")
    check_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 21}, headers=good), 400,
                "at most 20")
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=good)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 20
