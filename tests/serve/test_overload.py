"""Overload: far more clients than the queue holds. Each request completes or gets 429 with
Retry-After; nothing hangs; /metrics agrees with what the clients saw."""
from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from serve.server_config import ServerConfig
from tests.serve.helpers import ServerThread, build

CLIENTS = 500


def test_500_clients_against_a_small_queue(model_dir):
    cfg = ServerConfig(max_waiting_requests=8, shutdown_timeout_s=1.0)
    with ServerThread(build(model_dir, max_num_seqs=4), cfg) as srv:
        async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str | None, str | None]:
            body = {"prompt": f"Request {i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            if i % 3 == 0:
                body["stream"] = True
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"]
                    finish = [line for line in [x async for x in r.aiter_lines()] if '"finish_reason":"length"' in line]
                    return 200, None, "length" if len(finish) == 1 else "bad stream"
            r = await c.post("/v1/completions", json=body)
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"]
            return 200, None, r.json()["choices"][0]["finish_reason"]

        async def main() -> list[tuple[int, str | None, str | None]]:
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60, limits=limits) as c:
                return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(CLIENTS))), 120)

        results = asyncio.run(main())
        statuses = Counter(status for status, _, _ in results)
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[429] > 0 and statuses[200] >= 8, statuses
        for status, retry_after, detail in results:
            if status == 200:
                assert detail == "length"
            else:
                assert detail == "queue_full" and retry_after is not None and int(retry_after) >= 1
        srv.wait_idle()
        m = srv.metrics()
        assert m["pagedserve:http_requests_total{path=/v1/completions,status=200}"] == statuses[200]
        assert m["pagedserve:http_requests_total{path=/v1/completions,status=429}"] == statuses[429]
        assert m["pagedserve:requests_rejected_total{reason=queue_full}"] == statuses[429]
        assert m["pagedserve:request_success_total{finished_reason=length}"] == statuses[200]
        assert m["pagedserve:e2e_request_latency_seconds_count"] == statuses[200]
        assert m["pagedserve:generation_tokens_total"] == 8 * statuses[200]
        assert m["pagedserve:num_requests_running"] == 0 and m["pagedserve:num_requests_waiting"] == 0
