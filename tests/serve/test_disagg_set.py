"""serve/disagg.py's DisaggregatedSet in one process (no engine processes, no torch): a prefill and a
decode core (scheduler/disagg.py) over tests/scheduler/test_disagg.py's fake executor and transport,
each stepping on a thread, the pages sent (push) or copied by the decode side (pull). Outputs equal
one engine's; a full decode engine holds handed-off requests back and all complete; an abort while
the KV waits frees it on both sides; a failed transfer fails its request only and gives lent blocks
back; metrics count the transfers."""
from __future__ import annotations

import asyncio

import pytest

from scheduler.disagg import DecodeCore, PrefillCore
from scheduler.loop import AsyncEngine, LoopConfig
from scheduler.request import SamplingParams
from serve.disagg import DisaggregatedSet
from serve.metrics import Metrics
from serve.router import Router, RouterConfig
from tests.scheduler.test_disagg import BS, PROMPTS, FakeTransport, make, run_one

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


class FailingTransport(FakeTransport):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.fail = False

    def recv(self, blocks, peer, tag):
        if self.fail:
            self.fail = False
            self.mailbox.pop((peer, self.rank, tag))
            raise RuntimeError("link down")
        return super().recv(blocks, peer, tag)

    def pull(self, blocks, peer, src_blocks, tag):
        if self.fail:
            self.fail = False
            raise RuntimeError("link down")
        return super().pull(blocks, peer, src_blocks, tag)


@pytest.fixture(params=["push", "pull"])
def way(request):
    return request.param


def build(way: str, decode_blocks: int = 32, max_num_seqs: int = 8, num_prefill: int = 1,
          num_decode: int = 1) -> DisaggregatedSet:
    mailbox: dict = {}
    pools = {} if way == "pull" else None
    inner = LoopConfig(1 << 20)
    prefill, decode = [], []
    for rank in range(num_prefill):  # ranks as serve/disagg.py numbers them: prefill engines first
        p, pool_p = make(PrefillCore)
        p.transport = FakeTransport(pool_p, rank, mailbox, pools)
        prefill.append(AsyncEngine(p, inner))
    for rank in range(num_prefill, num_prefill + num_decode):
        d, pool_d = make(DecodeCore, decode_blocks, caching=False, max_num_seqs=max_num_seqs)
        d.transport = FailingTransport(pool_d, rank, mailbox, pools)
        decode.append(AsyncEngine(d, inner))
    return DisaggregatedSet(prefill, decode, Router(RouterConfig(BS, (32,) * num_prefill)), LoopConfig(64),
                            max_model_len=256)


def cores(s: DisaggregatedSet) -> tuple[PrefillCore, DecodeCore]:
    return s.prefill[0].core, s.decode[0].core  # type: ignore[return-value]


async def text_of(s: DisaggregatedSet, prompt: list[int], params: SamplingParams = PARAMS) -> tuple[str, str]:
    stream = await s.add_request(prompt, params)
    text, reason = "", None
    async for batch in stream:
        for _, out in batch:
            assert out.error is None, out.error
            text += out.new_text
            reason = out.finish_reason or reason
    return text, reason


async def idle(s: DisaggregatedSet) -> None:
    """Until both cores hold nothing (the cores' state, read between their steps)."""
    p, d = cores(s)
    for _ in range(1000):
        used = await s.prefill[0].call(lambda c: c.block_manager.num_used_blocks + len(c.held) + len(c.lent))
        used += await s.decode[0].call(lambda c: c.block_manager.num_used_blocks + len(c.arriving))
        if used == 0 and not s._requests:
            return
    raise AssertionError("the cores still hold blocks")


def test_outputs_equal_one_engines_and_transfers_are_counted(way):
    async def main():
        s = build(way)
        metrics = Metrics("m", s)
        await s.start()
        got = await asyncio.gather(*(text_of(s, p) for p in PROMPTS))
        await idle(s)
        await s.stop()
        return got, s.transfers.num_transfers, metrics.render().decode()

    got, moved, rendered = asyncio.run(main())
    assert [g[0] for g in got] == run_one(PROMPTS, PARAMS)[1]
    assert [g[1] for g in got] == ["length"] * len(PROMPTS)
    assert moved == len(PROMPTS)
    assert f'pagedserve:kv_transfers_total{{model_name="m"}} {float(len(PROMPTS))}' in rendered
    assert 'pagedserve:num_requests_running{model_name="m",role="decode"}' in rendered


def test_prompt_logprobs_come_from_the_prefill_engine_once(way):
    """The prefill engine scores the prompt (its first output carries the logprobs); the decode engine,
    which continues from the handed-over KV, adds none."""
    async def main():
        s = build(way)
        await s.start()
        found = []
        for prompt in PROMPTS:
            stream = await s.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0))
            async for batch in stream:
                found += [(prompt, out.prompt_logprobs) for _, out in batch if out.prompt_logprobs is not None]
        await idle(s)
        await s.stop()
        return found, s.transfers.num_transfers

    found, moved = asyncio.run(main())
    assert moved == len(PROMPTS) and len(found) == len(PROMPTS)
    for prompt, lps in found:
        assert [None if e is None else (e.token_id, e.logprob) for e in lps] == \
            [None] + [(t, -float(t)) for t in prompt[1:]]


def test_a_full_decode_engine_holds_requests_back(way):
    prompts = PROMPTS * 3

    async def main():
        s = build(way, decode_blocks=6, max_num_seqs=2)
        await s.start()
        got = await asyncio.gather(*(text_of(s, p) for p in prompts))
        await idle(s)
        await s.stop()
        return got

    assert [g[0] for g in asyncio.run(main())] == run_one(prompts, PARAMS)[1]


def test_an_abort_while_the_kv_waits_frees_both_sides(way):
    async def main():
        s = build(way, max_num_seqs=1)  # one decode at a time: the second request's KV must wait
        await s.start()
        long = await s.add_request(PROMPTS[1], SamplingParams(max_tokens=60, temperature=0.0))
        tokens = 0
        while tokens < 2:  # the prefill engine's token, then the decode engine's: it runs there
            tokens += sum(len(out.new_token_ids) for _, out in await long.__anext__())
        stream = await s.add_request(PROMPTS[0], PARAMS)
        first = await stream.__anext__()  # the prefill engine's token: the KV is now held there
        assert first[0][1].new_token_ids and not first[0][1].finished
        while not await s.decode[0].call(lambda c: len(c.arriving)):  # each call waits for a step
            pass
        assert await s.prefill[0].call(lambda c: len(c.held)) == 1
        stream.abort()
        rest = [out async for batch in stream for _, out in batch]
        assert [o.finish_reason for o in rest] == ["abort"]
        reasons = [out.finish_reason async for batch in long for _, out in batch]
        await idle(s)
        await s.stop()
        return reasons[-1]

    assert asyncio.run(main()) == "length"


def test_a_failed_transfer_fails_its_request_only(way):
    async def main():
        s = build(way)
        await s.start()
        _, d = cores(s)
        d.transport.fail = True
        stream = await s.add_request(PROMPTS[0], PARAMS)
        outs = [out async for batch in stream for _, out in batch]
        await idle(s)
        again = await text_of(s, PROMPTS[0])
        await s.stop()
        return outs, again

    outs, again = asyncio.run(main())
    assert outs[-1].finish_reason == "error" and "link down" in outs[-1].error
    assert again == (run_one(PROMPTS[:1], PARAMS)[1][0], "length")


def test_two_prefill_and_two_decode_engines_share_the_work(way):
    prompts = PROMPTS * 2

    async def main():
        s = build(way, num_prefill=2, num_decode=2)
        await s.start()
        got = await asyncio.gather(*(text_of(s, p) for p in prompts))
        steps = [e.snapshot.num_steps for e in s.prefill + s.decode]
        await s.stop()
        return got, steps

    got, steps = asyncio.run(main())
    assert [g[0] for g in got] == run_one(prompts, PARAMS)[1]
    assert all(n > 0 for n in steps)  # every engine took part
