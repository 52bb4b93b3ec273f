"""AsyncEngine on its own (no HTTP): streaming, merging, abort, admission, drain, faults, threads."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from scheduler.loop import AsyncEngine, EngineUnavailable, LoopConfig, QueueFull
from scheduler.policy import RequestRejected
from scheduler.request import SamplingParams
from serve.llm import LLM
from tests.serve.helpers import build, engine_config, recorded_schedules, record_schedules, used_blocks

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(model_dir):
    return build(model_dir)


def run(engine, body, config: LoopConfig | None = None):
    async def main():
        loop = AsyncEngine(engine.core, config)
        await loop.start()
        try:
            return await body(loop)
        finally:
            await loop.stop()
    return asyncio.run(main())


async def drain_stream(stream) -> tuple[str, list[int], str]:
    text, ids, reason = "", [], None
    async for batch in stream:
        for _, out in batch:
            text += out.new_text
            ids += out.new_token_ids
            reason = out.finish_reason or reason
    return text, ids, reason


def test_outputs_equal_offline_and_slow_consumers_get_merged_outputs(engine, model_dir):
    prompts = [engine.tokenizer.encode(p) for p in ("Hello there", "The capital of France", "1 2 3")]
    offline = LLM.from_config(engine_config(model_dir)).generate(prompts, GREEDY)

    async def body(loop):
        streams = [await loop.add_request(p, GREEDY) for p in prompts]
        while await loop.call(lambda core: core.has_unfinished()):  # nobody reads meanwhile: the outputs queue up
            await asyncio.sleep(0.01)
        batches = [b async for b in streams[0]]
        rest = [await drain_stream(s) for s in streams[1:]]
        return batches, rest

    batches, rest = run(engine, body)
    assert len(batches) == 1  # merged
    first = "".join(out.new_text for b in batches for _, out in b)
    assert [first] + [t for t, _, _ in rest] == [o.text for o in offline]
    assert [len(ids) for _, ids, _ in rest] == [16, 16]


def test_abort_frees_blocks_within_a_step(engine):
    async def body(loop):
        stream = await loop.add_request(engine.tokenizer.encode("Once upon a time"),
                                        SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        await stream.__anext__()
        assert loop.snapshot.num_free_blocks < loop.snapshot.num_blocks
        stream.abort()
        text, ids, reason = await drain_stream(stream)
        assert reason == "abort"
        return await loop.call(lambda core: (core.block_manager.num_used_blocks, core.has_unfinished(),
                                             core.scheduler.check_integrity()))

    assert run(engine, body) == (0, False, None)


def test_queue_full_and_rejections(model_dir):
    engine = build(model_dir, max_num_seqs=1)  # one runs, the rest wait

    async def body(loop):
        long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        ids = engine.tokenizer.encode("Hi")
        with pytest.raises(RequestRejected, match="context length"):
            await loop.add_request(list(range(600)), long)
        streams = [await loop.add_requests([(ids, long)] * 3)]
        await streams[0].__anext__()  # running: 1, waiting: 2
        assert loop.num_waiting == 2
        with pytest.raises(QueueFull) as e:
            await loop.add_requests([(ids, long)] * 2)
        assert e.value.retry_after_s >= 1
        streams.append(await loop.add_request(ids, long))  # 2 + 1 <= 3
        for s in streams:
            s.abort()
        return [(await drain_stream(s))[2] for s in streams]

    assert run(engine, body, LoopConfig(max_waiting_requests=3)) == ["abort", "abort"]


def test_rate_limit_spaces_out_admissions(engine):
    async def body(loop):
        ids = engine.tokenizer.encode("Hi")
        t0 = time.monotonic()
        streams = [await loop.add_request(ids, SamplingParams(max_tokens=1)) for _ in range(4)]
        for s in streams:
            await drain_stream(s)
        return time.monotonic() - t0

    assert run(engine, body, LoopConfig(max_request_rate=2.0)) >= 0.9  # 2 at once, 2 more a second later


def test_drain_aborts_what_does_not_finish_in_time(engine):
    async def body(loop):
        stream = await loop.add_request(engine.tokenizer.encode("Hi"),
                                        SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        await loop.drain(0.05)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            await loop.add_request([1, 2], GREEDY)
        return (await drain_stream(stream))[2]

    assert run(engine, body) == "abort"


def test_steps_run_on_one_worker_thread_and_the_event_loop_stays_free(engine):
    """Each step waits inside the executor until the event loop has ticked twice more: on the loop's own
    thread that could never happen. The wait gives up after 5 s, so a regression fails instead of hanging,
    and nothing depends on how fast this machine is."""
    seen: set[str] = set()
    ticks = [0]
    stalled: list[int] = []
    inner = engine.core.executor

    class LoopWatchingExecutor:
        def execute(self, batch):
            seen.add(threading.current_thread().name)
            start, deadline = ticks[0], time.monotonic() + 5.0
            while not stalled and ticks[0] < start + 2:
                if time.monotonic() > deadline:
                    stalled.append(start)
                time.sleep(0.001)
            return inner.execute(batch)

    engine.core.executor = LoopWatchingExecutor()

    async def body(loop):
        async def ticker():
            while True:
                await asyncio.sleep(0.001)
                ticks[0] += 1

        t = asyncio.create_task(ticker())
        out = await drain_stream(await loop.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True)))
        t.cancel()
        return out

    _, ids, reason = run(engine, body)
    assert len(ids) == 6 and reason == "length"
    assert seen and all(name.startswith("engine-step") for name in seen)
    assert not stalled  # the loop kept running while every step ran


def test_a_step_that_raises_fails_in_flight_requests_and_the_loop_goes_on(engine):
    real = engine.core.step
    fail = {"armed": True}

    def step():
        if fail.pop("armed", False):
            raise RuntimeError("boom")
        return real()

    engine.core.step = step

    async def body(loop):
        s = await loop.add_request([1, 2, 3], GREEDY)
        batches = [b async for b in s]
        out = batches[-1][-1][1]
        assert out.finish_reason == "error" and "boom" not in out.error
        again = await drain_stream(await loop.add_request([1, 2, 3], GREEDY))
        return loop.num_loop_faults, again[2]

    assert run(engine, body) == (1, "length")


def test_prefill_hold_starts_a_burst_together_and_keeps_outputs(model_dir):
    """With --prefill-hold-ms, a prompt on an idle engine waits for the quiet time, and prompts that
    arrive one by one while it decodes start as one prefill; the tokens are the offline engine's,
    the loop sleeps (not spins) while it holds, and no block stays taken."""
    engine = build(model_dir, prefill_hold_ms=300.0)
    record_schedules(engine.core)
    prompts = [engine.tokenizer.encode(p) for p in ("Hello there", "The capital of France", "1 2 3", "a b", "xyz")]
    offline = LLM.from_config(engine_config(model_dir)).generate(prompts, GREEDY)
    held = LLM.from_config(engine_config(model_dir, prefill_hold_ms=300.0)).generate(prompts, GREEDY)
    assert [o.token_ids for o in held] == [o.token_ids for o in offline]  # offline: one quiet time, then as before

    async def body(loop):
        t0 = time.monotonic()
        first = await loop.add_request(prompts[0], GREEDY)
        it = first.__aiter__()
        got = list(await it.__anext__())
        waited = time.monotonic() - t0
        later = []
        for p in prompts[1:]:  # a burst, one by one while the first decodes
            later.append(await loop.add_request(p, GREEDY))
            await asyncio.sleep(0.01)
        async for batch in it:
            got += batch
        rest = [await drain_stream(s) for s in later]
        return [out for _, out in got], rest, waited

    outs, rest, waited = run(engine, body)
    assert [sum((o.new_token_ids for o in outs), [])] + [ids for _, ids, _ in rest] == [o.token_ids for o in offline]
    started, empty = recorded_schedules(engine.core)
    assert [len(s) for s in started] == [1, 4]
    assert waited >= 0.3 and empty < 50
    assert engine.core.scheduler.num_held_steps > 0 and used_blocks(engine.core) == 0
