"""serve/replicas.py's ReplicaSet over fake core clients (no processes, milliseconds): routing and
its load bookkeeping, a replica's death failing its own requests only, the last death stopping the
server, admission limits over all replicas, health and the summed snapshot."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.loop import AsyncEngine, EngineSnapshot, EngineUnavailable, LoopConfig, QueueFull
from scheduler.request import SamplingParams, StepOutput
from serve.metrics import Metrics
from serve.replicas import ReplicaSet, total_snapshot
from serve.router import Router, RouterConfig

PARAMS = SamplingParams(max_tokens=4)


class FakeClient:
    """A CoreClient whose test decides when sequences finish and when it dies."""

    def __init__(self, blocks: int = 8) -> None:
        self.snapshot = EngineSnapshot(num_blocks=blocks, num_free_blocks=blocks)
        self.events = None
        self.up = False
        self.added: list[int] = []
        self.aborted: list[int] = []

    @property
    def alive(self) -> bool:
        return self.up

    async def start(self, events) -> None:
        self.events, self.up = events, True

    def notify(self) -> None:
        pass

    async def add(self, seq_ids, requests) -> None:
        if not self.up:
            raise EngineUnavailable("the engine process is not running")
        self.added += seq_ids

    async def abort(self, seq_ids) -> None:
        self.aborted += seq_ids

    async def call(self, fn):
        return fn(self)

    async def close(self) -> None:
        self.up = False

    def finish(self, sid: int) -> None:
        self.events.on_outputs([StepOutput(sid, [7], True, "length", num_output_tokens=1)])

    def die(self, why: str) -> None:
        self.up = False
        self.events.on_dead(why)


def replica_set(n: int = 2, **loop) -> tuple[ReplicaSet, list[FakeClient]]:
    clients = [FakeClient() for _ in range(n)]
    router = Router(RouterConfig(4, (64,) * n))
    rs = ReplicaSet([AsyncEngine(c, LoopConfig()) for c in clients], router, LoopConfig(**loop))
    return rs, clients


def run(coro):
    return asyncio.run(coro)


def test_requests_spread_and_the_load_returns_to_zero():
    async def main():
        rs, (a, b) = replica_set()
        await rs.start()
        s1 = await rs.add_request([1, 2, 3, 4, 5], PARAMS)
        s2 = await rs.add_request([9, 9, 9, 9, 9, 9], PARAMS)
        assert (a.added, b.added) == ([s1.seq_ids[0]], [s2.seq_ids[0]])
        assert rs._prompt_tokens == [5, 6] and rs.num_in_flight == 2
        a.finish(s1.seq_ids[0])
        b.finish(s2.seq_ids[0])
        assert rs._prompt_tokens == [0, 0] and rs.num_in_flight == 0
        # the same prompt again goes where its block is, though replica 1 would be next by load
        s3 = await rs.add_request([1, 2, 3, 4, 5], PARAMS)
        assert a.added[-1] == s3.seq_ids[0]
        s3.abort()  # an abort reaches the request's replica only
        await asyncio.sleep(0)
        assert a.aborted == s3.seq_ids and b.aborted == []
        await rs.stop()

    run(main())


def test_a_dead_replica_fails_its_own_requests_and_the_last_stops_the_server():
    async def main():
        rs, (a, b) = replica_set()
        failures = []
        rs.on_failure = failures.append
        await rs.start()
        s1 = await rs.add_request([1] * 8, PARAMS)
        s2 = await rs.add_request([2] * 8, PARAMS)
        a.die("the engine process exited unexpectedly (killed by signal SIGKILL)")
        (out1,) = [o for batch in [x async for x in s1] for _, o in batch]
        assert out1.finish_reason == "error" and "SIGKILL" in out1.error
        assert rs.num_in_flight == 1 and rs.accepting and failures == []
        status, body = rs.health()
        assert status == 200 and body["status"] == "degraded"
        assert body["replicas"][0]["status"] == "failed" and body["replicas"][1] == {"replica": 1, "status": "ok"}
        s3 = await rs.add_request([1] * 8, PARAMS)  # its prefix was on replica 0: it goes to 1 now
        assert b.added == [s2.seq_ids[0], s3.seq_ids[0]]
        b.finish(s2.seq_ids[0])
        b.die("gone too")
        assert failures == ["every replica has failed; the last: gone too"] and not rs.accepting
        with pytest.raises(EngineUnavailable, match="every replica has failed"):
            await rs.add_request([3] * 8, PARAMS)
        assert rs.health()[0] == 503
        await rs.stop()

    run(main())


def test_a_replica_dying_unreported_is_routed_around():
    async def main():
        rs, (a, b) = replica_set()
        await rs.start()
        a.up = False  # its process is gone; the death is not reported yet
        s = await rs.add_request([1] * 8, PARAMS)
        assert b.added == s.seq_ids and rs._prompt_tokens == [0, 8]
        await rs.stop()

    run(main())


def test_admission_limits_are_over_all_replicas():
    async def main():
        rs, clients = replica_set(max_waiting_requests=3)
        await rs.start()
        for c in clients:
            c.snapshot = EngineSnapshot(num_waiting=1)
        await rs.add_request([1], PARAMS)
        with pytest.raises(QueueFull):
            await rs.add_requests([([1], PARAMS), ([2], PARAMS)])
        await rs.drain(0.0)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            await rs.add_request([1], PARAMS)
        await rs.stop()

    run(main())


def test_metrics_per_replica_and_total():
    async def main():
        rs, (a, b) = replica_set()
        metrics = Metrics("m", rs)
        await rs.start()
        s = await rs.add_request([1, 2, 3], PARAMS)
        b.snapshot = EngineSnapshot(num_running=1, num_blocks=8, num_free_blocks=6, generation_tokens=5)
        a.finish(s.seq_ids[0])
        text = metrics.render().decode()
        await rs.stop()
        return text

    text = run(main())
    assert 'pagedserve:request_success_total{finished_reason="length",model_name="m",replica=""} 1.0' in text
    assert 'pagedserve:request_success_total{finished_reason="length",model_name="m",replica="0"} 1.0' in text
    assert 'pagedserve:kv_cache_used_blocks{model_name="m",replica=""} 2.0' in text
    assert 'pagedserve:kv_cache_used_blocks{model_name="m",replica="1"} 2.0' in text
    assert 'pagedserve:replica_up{model_name="m",replica=""} 2.0' in text
    assert 'pagedserve:time_to_first_token_seconds_count{model_name="m",replica="0"} 1.0' in text


def test_total_snapshot():
    s = total_snapshot([EngineSnapshot(num_running=2, num_blocks=4, num_free_blocks=1, prefix_cache_hits=None,
                                       has_unfinished=True),
                        EngineSnapshot(num_running=1, num_blocks=4, num_free_blocks=4, prefix_cache_hits=3)])
    assert (s.num_running, s.num_blocks, s.num_free_blocks, s.prefix_cache_hits, s.has_unfinished) == (3, 8, 5, 3, True)
    assert s.kv_usage == pytest.approx(3 / 8)
