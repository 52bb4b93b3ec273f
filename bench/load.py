"""Drive the load: send the requests on their arrival schedule, at most `concurrency` in flight."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from bench.client import CompletionTarget, RequestResult, list_models, stream_completion
from bench.workload import BenchRequest


@dataclass(frozen=True)
class LoadPlan:
    arrivals: list[float]  # seconds after the start, one per request (bench.workload.arrival_offsets)
    concurrency: int | None = None  # None: no cap (closed loop when arrivals are all 0)
    progress: bool = True
    request_timeout_s: float = 6 * 3600.0


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration_s: float  # first request sent -> last response finished
    client_cpu_s: float = 0.0  # this process's CPU time meanwhile: near duration_s, the client is the bottleneck


def _session(limit: int, timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def run_load(target: CompletionTarget, requests: list[BenchRequest], plan: LoadPlan) -> LoadResult:
    if len(plan.arrivals) != len(requests):
        raise ValueError("one arrival offset per request")
    limit = plan.concurrency or len(requests)
    slots = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    # disable=None: tqdm draws only on a terminal
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=None if plan.progress else True)
    async with _session(limit, plan.request_timeout_s) as session:
        start = time.perf_counter()
        cpu_start = time.process_time()

        async def one(request: BenchRequest) -> RequestResult:
            try:
                return await stream_completion(session, target, request, start)
            finally:
                if slots is not None:
                    slots.release()
                bar.update(1)

        tasks = []
        for request, offset in zip(requests, plan.arrivals):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    bar.close()
    return LoadResult(results=list(results), duration_s=duration, client_cpu_s=cpu)


async def probe(target: CompletionTarget, request: BenchRequest, timeout_s: float = 600.0) -> RequestResult:
    """One short request before the run: it fails fast on a wrong URL or model name and keeps
    first-request warm-up out of the figures."""
    async with _session(1, timeout_s) as session:
        return await stream_completion(session, target, request, time.perf_counter(),
                                       max_tokens=min(2, request.output_len))


async def discover_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str | None:
    async with _session(1, timeout_s) as session:
        models = await list_models(session, base_url, api_key)
    return models[0] if models else None
