"""Clients that go away: their requests are aborted and their KV blocks freed within a step."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.serve.helpers import ServerThread, build, used_blocks

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["thread", "process"])
def srv(request, model_dir):
    if request.param == "process":
        yield request.getfixturevalue("process_server")  # the same engine settings
        return
    with ServerThread(build(model_dir, max_num_seqs=64, num_kv_blocks=256)) as s:
        yield s


def aborted(srv) -> float:
    return srv.metrics().get("pagedserve:request_success_total{finished_reason=abort}", 0.0)


def test_client_dropping_mid_stream_frees_everything(srv):
    before = aborted(srv)
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                while not next(lines).startswith("data:"):
                    pass
            assert srv.call(used_blocks) > 0
    t0 = time.monotonic()
    srv.wait_idle(timeout=5)
    assert time.monotonic() - t0 < 1.0  # a step is milliseconds; 400 tokens would take far longer
    assert aborted(srv) == before + 1


def test_non_streaming_client_that_gives_up_is_aborted(srv):
    before = aborted(srv)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.base_url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.2))
    srv.wait_idle(timeout=5)
    assert aborted(srv) == before + 1


def test_100_streaming_clients_drop_at_random_points(srv):
    rng = random.Random(1234)
    drops = [rng.choice([0, 0, 1, 2, 5, 10, 30, 80, None]) for _ in range(100)]  # None: read to the end

    async def client(c: httpx.AsyncClient, drop_after: int | None, i: int) -> str:
        body = {"prompt": f"Client {i} says", "max_tokens": rng.randint(20, 120), "temperature": 0.8, "seed": i,
                "ignore_eos": True, "stream": True, **({"n": 2} if i % 10 == 0 else {})}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            if drop_after == 0:
                return "dropped"  # gone before the first token
            seen = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data:"):
                    seen += 1
                    if drop_after is not None and seen >= drop_after:
                        return "dropped"
        return "cut"

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(client(c, d, i) for i, d in enumerate(drops)))

    results = asyncio.run(main())
    assert "cut" not in results
    assert all(r == "done" for r, d in zip(results, drops) if d is None)
    assert results.count("dropped") > 50
    srv.wait_idle(timeout=10)
    m = srv.metrics()
    assert m["pagedserve:num_requests_running"] == 0 and m["pagedserve:num_requests_waiting"] == 0
    assert m["pagedserve:kv_cache_used_blocks"] == 0
