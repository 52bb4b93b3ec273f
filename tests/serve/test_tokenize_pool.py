"""The tokenizing processes beside the event loop (serve/tokenize_pool.py): the planner's ids, many
requests at once, a dead worker fails only what it held, and the server plans through them."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from serve.build import TokenIdTokenizer
from serve.prompts import RequestPlanner, rust_encoder
from serve.protocol import ChatCompletionRequest, CompletionRequest
from serve.server_config import ServerConfig
from serve.tokenize_pool import MAX_WORKERS, TokenizePool, TokenizerGone, pool_size
from tests.serve.test_prompt_encode import _texts, _tokenizer


def test_pool_size():
    assert [pool_size(c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, MAX_WORKERS]
    assert TokenizePool.for_tokenizer(TokenIdTokenizer(384)) is None  # no Rust tokenizer


def test_same_ids_as_the_planner_many_at_once(tmp_path):
    tok = _tokenizer(tmp_path, bos=True)
    encode = rust_encoder(tok)
    texts = _texts(tok, n=150, seed=4)

    async def run():
        pool = TokenizePool.for_tokenizer(tok, workers=2)
        await pool.start()
        try:
            singles = await asyncio.gather(*[pool.encode([t], add) for t in texts for add in (True, False)])
            batch = await pool.encode(texts, True)
        finally:
            pool.close()
        return singles, batch

    singles, batch = asyncio.run(run())
    assert [s[0] for s in singles] == [encode(t, add) for t in texts for add in (True, False)]
    assert batch == [encode(t, True) for t in texts]


def test_a_dead_worker_fails_what_it_held_and_the_rest_go_on(tmp_path):
    tok = _tokenizer(tmp_path)

    async def run():
        pool = TokenizePool.for_tokenizer(tok, workers=2)
        await pool.start()
        try:
            await pool.encode(["warm"], True)
            victim = pool._workers[0]
            os.kill(victim.proc.pid, signal.SIGSTOP)  # it takes the next request and never answers
            held = asyncio.ensure_future(pool.encode(["held by the stopped worker"], True))
            await asyncio.sleep(0.05)
            assert victim.pending  # the least loaded worker was the stopped one: it holds the request
            os.kill(victim.proc.pid, signal.SIGKILL)
            with pytest.raises(TokenizerGone):
                await asyncio.wait_for(held, 10)
            assert pool.alive and not victim.alive
            assert await pool.encode(["still served"], False) == [tok.encode("still served", add_special_tokens=False)]
            os.kill(pool._workers[1].proc.pid, signal.SIGKILL)
            for _ in range(200):
                if not pool.alive:
                    break
                await asyncio.sleep(0.01)
            assert not pool.alive
            with pytest.raises(TokenizerGone):
                await pool.encode(["x"], True)
        finally:
            pool.close()

    asyncio.run(run())


def test_server_plans_text_through_the_pool(tmp_path):
    """The API's plan of a text completion and of a chat: the planner's, with the texts encoded in
    the pool; a dead pool falls back to the planner's own encoder."""
    from serve.api import _planned

    tok = _tokenizer(tmp_path, bos=True)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    planner = RequestPlanner(tok, 384, 4096, ServerConfig())

    class State:
        tokenizers = TokenizePool.for_tokenizer(tok, workers=1)
        tokenize = None

    State.planner = planner
    comp = CompletionRequest.model_validate({"prompt": ["one text", "and another"], "max_tokens": 3})
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi there"}]})

    async def run():
        from concurrent.futures import ThreadPoolExecutor

        State.tokenize = ThreadPoolExecutor(1)
        await State.tokenizers.start()
        try:
            a = await _planned(State, planner.completion_draft, comp)
            b = await _planned(State, planner.chat_draft, chat)
            State.tokenizers.close()  # none left: the thread plans
            c = await _planned(State, planner.completion_draft, comp)
        finally:
            State.tokenizers.close()
            State.tokenize.shutdown()
        return a, b, c

    a, b, c = asyncio.run(run())
    want = planner.completion(comp)
    assert [p.token_ids for p in a.prompts] == [p.token_ids for p in want.prompts] == [p.token_ids for p in c.prompts]
    assert [p.text for p in a.prompts] == ["one text", "and another"]
    assert b.prompts[0].token_ids == planner.chat(chat).prompts[0].token_ids
