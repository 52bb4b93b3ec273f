"""Prometheus metrics, named like vLLM's where they mean the same, with a `pagedserve:` prefix.

Gauges and engine counters are read from the AsyncEngine's latest snapshot at scrape time;
per-request latencies are observed as requests finish (Metrics is the loop's observer). Each app
has its own registry: nothing global.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.loop import AsyncEngine, RequestRecord

PREFIX = "pagedserve:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
KNOWN_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


class _EngineCollector(Collector):
    def __init__(self, model: str, engine: AsyncEngine) -> None:
        self.model = model
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.engine.snapshot

        def metric(kind: type, name: str, doc: str, value: float):
            m = kind(PREFIX + name, doc, labels=["model_name"])
            m.add_metric([self.model], value)
            return m

        yield metric(GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", s.num_running)
        yield metric(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to run (admitted, not yet running).",
                     self.engine.num_waiting)
        yield metric(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s.kv_usage)
        yield metric(GaugeMetricFamily, "kv_cache_used_blocks", "KV-cache blocks in use.", s.num_blocks - s.num_free_blocks)
        yield metric(GaugeMetricFamily, "kv_cache_total_blocks", "KV-cache blocks in the pool.", s.num_blocks)
        yield metric(CounterMetricFamily, "num_preemptions", "Preemptions (sequences evicted to be recomputed).",
                     s.num_preemptions)
        yield metric(CounterMetricFamily, "prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens)
        yield metric(CounterMetricFamily, "generation_tokens", "Tokens generated.", s.generation_tokens)
        yield metric(CounterMetricFamily, "engine_steps", "Engine steps run.", s.num_steps)
        yield metric(CounterMetricFamily, "engine_step_failures",
                     "Model steps that raised; their requests failed with an error.", s.num_step_failures + self.engine.num_loop_faults)
        if s.prefix_cache_queries is not None:
            yield metric(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                         s.prefix_cache_queries)
        if s.prefix_cache_hits is not None:
            yield metric(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                         s.prefix_cache_hits)


class Metrics:
    """The app's registry; also the AsyncEngine's LoopObserver (it attaches itself)."""

    def __init__(self, model: str, engine: AsyncEngine) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model, engine))
        engine.observer = self
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the first.",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram(PREFIX + "request_prompt_tokens", "Prompt length per request.", m,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.output_len = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per request.", m,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.finished = Counter(PREFIX + "request_success", "Finished sequences by finish reason "
                                "(stop, length, abort, error).", [*m, "finished_reason"], registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused at admission, by reason.",
                                [*m, "reason"], registry=r)
        self.http = Counter(PREFIX + "http_requests", "HTTP responses by path and status.", ["path", "status"], registry=r)

    # LoopObserver
    def request_finished(self, rec: RequestRecord) -> None:
        self.finished.labels(self.model, rec.finish_reason or "unknown").inc()
        self.prompt_len.labels(self.model).observe(rec.num_prompt_tokens)
        self.output_len.labels(self.model).observe(rec.num_output_tokens)
        if rec.finish is not None:
            self.e2e.labels(self.model).observe(rec.finish - rec.arrival)
        if rec.first_token is not None:
            self.ttft.labels(self.model).observe(rec.first_token - rec.arrival)
            if rec.finish is not None and rec.num_output_tokens > 1:
                self.tpot.labels(self.model).observe((rec.finish - rec.first_token) / (rec.num_output_tokens - 1))

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """The registry's metrics less prometheus_client's `*_created` series (each counter's and
    histogram's creation time), which double every series and which no dashboard of ours reads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class HttpMetricsMiddleware:
    """Counts responses by path and status (unknown paths share one label, to bound cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
