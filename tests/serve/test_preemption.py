"""KV exhaustion: far more demand than blocks. Preemption keeps every request alive, and greedy
outputs equal those of a run with room to spare."""
from __future__ import annotations

import asyncio

import openai
import pytest

from scheduler.request import SamplingParams
from serve.llm import LLM
from tests.serve.helpers import ServerThread, build, engine_config

PROMPTS = [f"Request number {i}: the quick brown fox" for i in range(10)]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_preemption_keeps_greedy_outputs(model_dir, prefix_caching):
    roomy = LLM.from_config(engine_config(model_dir, num_kv_blocks=256))
    expected = [o.text for o in roomy.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]
    # 10 requests x ~52 tokens need ~40 blocks of 16; the pool has 8, enough for any one of them.
    with ServerThread(build(model_dir, num_kv_blocks=8, enable_prefix_caching=prefix_caching)) as srv:
        async def main() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0) as c:
                async def one(p: str) -> str:
                    r = await c.completions.create(model=srv.state.model_name, prompt=p, max_tokens=40, temperature=0,
                                                   extra_body={"ignore_eos": True})
                    assert r.choices[0].finish_reason == "length"
                    return r.choices[0].text
                return await asyncio.gather(*(one(p) for p in PROMPTS))

        assert asyncio.run(main()) == expected
        srv.wait_idle()
        assert srv.metrics()["pagedserve:num_preemptions_total"] > 0
