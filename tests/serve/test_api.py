"""The OpenAI API against a real uvicorn server, through the official openai client."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from scheduler.request import SamplingParams
from serve.llm import LLM
from tests.serve.helpers import ServerThread, build, engine_config

PROMPTS = ["The quick brown fox", "Paris is the capital of", "1 2 3 4 5", "Hello, world! How are"]


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, server):
    """Every test here runs against both engine loops: the shared thread server, then the process one."""
    return server if request.param == "thread" else request.getfixturevalue("process_server")


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM.from_config(engine_config(model_dir))


def greedy(offline, prompts, max_tokens=12, **kw):
    return [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True, **kw))]


def test_completion_greedy_equals_offline(client, server, offline):
    expected = greedy(offline, PROMPTS)
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model=server.state.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "length"
        n_prompt = len(offline.tokenizer.encode(prompt))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
    server.wait_idle()


def test_streamed_chunks_concatenate_to_the_whole(client, server):
    for prompt in PROMPTS:
        kw = dict(model=server.state.model_name, prompt=prompt, max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_streaming_and_not(client, server, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a capital."}]
    expected = greedy(offline, [offline.chat_prompt(messages)], max_tokens=15)[0]
    kw = dict(model=server.state.model_name, messages=messages, max_tokens=15, temperature=0,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(offline.chat_prompt(messages)) and r.usage.completion_tokens == 15
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_prompt_forms_and_n(client, server, offline):
    ids = offline.tokenizer.encode(PROMPTS[0])
    expected = greedy(offline, PROMPTS[:2], max_tokens=8)
    name = server.state.model_name
    kw = dict(model=name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(prompt=ids, **kw).choices[0].text == expected[0]
    r = client.completions.create(prompt=PROMPTS[:2], n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected[0]] * 2 + [expected[1]] * 2
    prompt_tokens = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS[:2])
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 32
    r = client.completions.create(prompt=[ids, offline.tokenizer.encode(PROMPTS[1])], **kw)
    assert [c.text for c in r.choices] == expected
    # streaming with n: every choice index ends once
    chunks = list(client.completions.create(prompt=PROMPTS[0], n=3, stream=True, **kw))
    ends = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert ends == [0, 1, 2]
    for i in range(3):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == expected[0]


def test_sampling_seeded_is_reproducible_and_n_differs(client, server):
    kw = dict(model=server.state.model_name, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1


def test_echo_and_stop(client, server, offline):
    name = server.state.model_name
    r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPTS[0] + greedy(offline, [PROMPTS[0]], max_tokens=6)[0]
    full = greedy(offline, [PROMPTS[2]], max_tokens=20)[0]
    stop = full[5:8]
    assert stop.strip(), full
    r = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]
    chunks = list(client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_vllm_prompt_and_stop_extensions(client, server, offline):
    """include_stop_str_in_output keeps the stop string; truncate_prompt_tokens serves the prompt's
    last N tokens; continue_final_message goes on with the last assistant message (its rendering by
    the chat template without a new turn); one model by GET /v1/models/{id}."""
    name = server.state.model_name
    full = greedy(offline, [PROMPTS[2]], max_tokens=20)[0]
    stop = full[5:8]
    r = client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop) + len(stop)]
    chunks = list(client.completions.create(model=name, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True,
                                                                     "include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text

    ids = offline.tokenizer.encode(PROMPTS[1] + " and the largest city of France")
    tail = ids[-4:]
    r = client.completions.create(model=name, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].text == greedy(offline, [tail], max_tokens=5)[0]

    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello! My name is"}]
    rendered = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                     continue_final_message=True, tokenize=False)
    assert rendered.endswith("My name is")
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                   "ignore_eos": True})
    want = greedy(offline, [offline.tokenizer.encode(rendered, add_special_tokens=False)], max_tokens=5)[0]
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(rendered, add_special_tokens=False))

    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_logprobs_shapes(client, server):
    name = server.state.model_name
    r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4 and top[tok] == val
        assert val == max(top.values())  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)
    c = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content if not t.token.startswith("bytes:"))
    chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # (the second request reuses the first's prompt KV from the prefix cache: equal up to rounding)
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_16_concurrent_clients(server, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    expected = greedy(offline, prompts, max_tokens=24)
    name = server.state.model_name

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        if i % 2:
            r = await c.completions.create(model=name, prompt=prompts[i], max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})
            return r.choices[0].text
        parts = []
        async for ch in await c.completions.create(model=name, prompt=prompts[i], max_tokens=24, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
            parts.append(ch.choices[0].text)
        return "".join(parts)

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    assert asyncio.run(main()) == expected
    server.wait_idle()


def test_models_health_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.state.model_name]
    assert server.http.get("/health").json() == {"status": "ok"}
    client.completions.create(model=server.state.model_name, prompt="Hello", max_tokens=3)
    m = server.metrics()
    for name in ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting", "pagedserve:kv_cache_usage_perc",
                 "pagedserve:num_preemptions_total", "pagedserve:prompt_tokens_total",
                 "pagedserve:generation_tokens_total", "pagedserve:time_to_first_token_seconds_count",
                 "pagedserve:time_per_output_token_seconds_count", "pagedserve:e2e_request_latency_seconds_count",
                 "pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total"):
        assert name in m, name
    assert m["pagedserve:generation_tokens_total"] >= 3
    assert m["pagedserve:e2e_request_latency_seconds_count"] >= 1
    server.wait_idle()
    m = server.metrics()
    assert m["pagedserve:num_requests_running"] == 0 and m["pagedserve:kv_cache_usage_perc"] == 0


def test_several_served_model_names(model_dir):
    """--served-model-name a b: requests may name either; responses name the first."""
    import httpx

    from serve.cli import build_parser
    from serve.run_cmd import server_config_from_args
    from serve.server_config import ServerConfig

    args = build_parser().parse_args(["run", "--served-model-name", "main", "alias", "--max-model-len", "2k"])
    cfg = server_config_from_args(args)
    assert (cfg.served_model_name, cfg.model_aliases) == ("main", ("alias",))
    assert args.max_model_len == 2048  # 32k-style lengths, as serve kv-calc reads them
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--max-model-len", "lots"])
    with ServerThread(build(model_dir), ServerConfig(served_model_name="main", model_aliases=("alias",),
                                                     shutdown_timeout_s=1.0)) as srv:
        assert [m["id"] for m in srv.http.get("/v1/models").json()["data"]] == ["main", "alias"]
        assert srv.http.get("/v1/models/alias").json()["id"] == "alias"
        r = srv.http.post("/v1/completions", json={"model": "alias", "prompt": "Hi", "max_tokens": 2}).json()
        assert r["model"] == "main"
        other = httpx.post(f"{srv.base_url}/v1/completions", json={"model": "other", "prompt": "Hi"})
        assert other.status_code == 404 and "'main', 'alias'" in other.json()["error"]["message"]


def test_return_token_ids_extension(server, offline):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = server.http.post("/v1/completions", json=body).json()
    want = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert whole["choices"][0]["token_ids"] == want
    ids = []
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    assert ids == want
    plain = server.http.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert plain["choices"][0]["token_ids"] is None


def test_penalties_bias_min_p_and_min_tokens(client, server, offline):
    """The OpenAI and vLLM fields that shape the logits reach the engine: each output equals the
    offline engine's with the same SamplingParams (engine/logit_adjust.py's own tests check those)."""
    name = server.state.model_name
    cases = [
        ({"presence_penalty": 1.2, "frequency_penalty": 0.6}, {"presence_penalty": 1.2, "frequency_penalty": 0.6}),
        ({"logit_bias": {"42": 100}}, {"logit_bias": {42: 100.0}}),
        ({"extra_body": {"repetition_penalty": 1.5, "min_p": 0.2}}, {"repetition_penalty": 1.5, "min_p": 0.2}),
    ]
    for fields, kw in cases:
        body = dict(fields)
        extra = {"ignore_eos": True, **body.pop("extra_body", {})}
        r = client.completions.create(model=name, prompt=PROMPTS[3], max_tokens=10, temperature=0, extra_body=extra,
                                      **body)
        assert r.choices[0].text == greedy(offline, [PROMPTS[3]], max_tokens=10, **kw)[0], fields
    body = {"prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0.8, "ignore_eos": True, "return_token_ids": True,
            "logit_bias": {"42": 100}}
    assert server.http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == [42] * 6
    body = {**body, "logit_bias": None, "allowed_token_ids": [42, 43, 44], "max_tokens": 12}
    assert set(server.http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]) <= {42, 43, 44}
    # min_tokens: the stop token the free output ends on first is held back for 4 tokens
    free = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stop_token_ids": [free[0]], "min_tokens": 4}
    ids = server.http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert len(ids) >= 4 and free[0] not in ids[:4]
    assert ids == offline.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                stop_token_ids=[free[0]], min_tokens=4))[0].token_ids
    server.wait_idle()


def test_tokenize_detokenize_and_version(server, offline):
    """vLLM's /tokenize (a prompt, or chat messages through the template), /detokenize and /version."""
    tok = offline.tokenizer
    r = server.http.post("/tokenize", json={"prompt": PROMPTS[1], "return_token_strs": True}).json()
    assert r["tokens"] == list(tok.encode(PROMPTS[1])) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.state.engine.max_model_len
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    r = server.http.post("/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False}).json()
    assert r["tokens"] == list(tok.encode(PROMPTS[1], add_special_tokens=False)) and r["token_strs"] is None
    messages = [{"role": "user", "content": "Name a capital."}]
    r = server.http.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == offline.chat_prompt(messages)
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {"type": "object"}}}]
    with_tools = server.http.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    assert with_tools["count"] > r["count"]  # the tools are described to the model, as the chat endpoint does
    chat = server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "tools": tools})
    assert chat.json()["usage"]["prompt_tokens"] == with_tools["count"]
    chat = server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r["count"]
    r = server.http.post("/detokenize", json={"tokens": tok.encode(PROMPTS[2], add_special_tokens=False)}).json()
    assert r == {"prompt": PROMPTS[2]}
    v = server.http.get("/version")
    assert v.status_code == 200 and isinstance(v.json()["version"], str)
    server.wait_idle()


def _offline_prompt_logprobs(offline, ids, k):
    out = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k))[0]
    return out.prompt_logprobs


def test_echo_with_logprobs_scores_the_prompt(client, server, offline):
    """What scoring clients send (lm-evaluation-harness: echo, logprobs 1, max_tokens 1; the legacy
    form with max_tokens 0): the prompt's tokens lead the logprobs, the first without one."""
    name = server.state.model_name
    ids = offline.encode(PROMPTS[1])
    want = _offline_prompt_logprobs(offline, ids, 2)
    r = client.completions.create(model=name, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([e.logprob for e in want[1:]], abs=1e-4)
    for tok, val, top in zip(lp.tokens[1:n], lp.token_logprobs[1:n], lp.top_logprobs[1:n]):
        assert top[tok] == val and 2 <= len(top) <= 3
    assert "".join(lp.tokens[:n]) == PROMPTS[1] and r.choices[0].text.startswith(PROMPTS[1])
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:j])) for j in range(n)]
    # max_tokens 0: the prompt and its logprobs only
    r0 = client.completions.create(model=name, prompt=ids, max_tokens=0, temperature=0, echo=True, logprobs=2)
    c0 = r0.choices[0]
    assert c0.text == PROMPTS[1] and c0.finish_reason == "length" and r0.usage.completion_tokens == 0
    assert c0.logprobs.token_logprobs == lp.token_logprobs[:n]
    # streamed: the echo arrives with the prompt's logprobs in the first chunk
    chunks = list(client.completions.create(model=name, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPTS[1]) and first.logprobs.token_logprobs[:n] == lp.token_logprobs[:n]
    assert "".join(c.choices[0].text for c in chunks) == client.completions.create(
        model=name, prompt=ids, max_tokens=3, temperature=0, echo=True).choices[0].text
    chunks0 = list(client.completions.create(model=name, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks0) == PROMPTS[1]
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks0 if c.choices[0].logprobs) == n
    server.wait_idle()


def test_prompt_logprobs_field(client, server, offline):
    """vLLM's prompt_logprobs: per prompt token (None first) the token's own entry with its rank, then
    the top ones by rank; on completions per choice, on chat for the response."""
    name = server.state.model_name
    ids = offline.encode(PROMPTS[2])
    want = _offline_prompt_logprobs(offline, ids, 3)
    r = client.completions.create(model=name, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for entry, w in zip(got[1:], want[1:]):
        own = entry[str(w.token_id)]
        assert own["logprob"] == pytest.approx(w.logprob, abs=1e-4) and own["rank"] == w.rank
        assert own["decoded_token"] == offline.tokenizer.decode([w.token_id])
        assert sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
        assert len(entry) == 3 + (w.rank > 3)  # the top three, and the token itself where it is not among them
    plain = client.completions.create(model=name, prompt=ids, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_extra and plain.choices[0].text == r.choices[0].text
    messages = [{"role": "user", "content": "Name a capital."}]
    c = client.chat.completions.create(model=name, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    chat_ids = offline.chat_prompt(messages)
    got = c.model_extra["prompt_logprobs"]
    assert len(got) == len(chat_ids) and got[0] is None
    want = _offline_prompt_logprobs(offline, chat_ids, 0)
    assert [list(e) for e in got[1:]] == [[str(w.token_id)] for w in want[1:]]
    server.wait_idle()
