"""Prometheus metrics, named like vLLM's where they mean the same, with a `pagedserve:` prefix.

Gauges and engine counters are read from the AsyncEngine's latest snapshot at scrape time;
per-request latencies are observed as requests finish (Metrics is the loop's observer). Each app
has its own registry: nothing global; with several API processes (serve/api_processes.py) the
counters and histograms are summed over them from prometheus_client's multiprocess files.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.disagg import Received
from scheduler.loop import AsyncEngine, EngineSnapshot, RequestRecord
from serve.api_processes import METRICS_DIR_ENV
from serve.disagg import ROLES, DisaggregatedSet
from serve.replicas import ReplicaSet, total_snapshot

PREFIX = "pagedserve:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
KNOWN_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/score",
                         "/v1/rerank", "/v1/models", "/health", "/metrics"})


@dataclass(frozen=True)
class _Source:
    """One row of engine figures: a whole server, or one data-parallel replica of it."""

    labels: tuple[str, ...]
    snapshot: EngineSnapshot
    num_waiting: int
    up: bool = True


class _EngineCollector(Collector):
    def __init__(self, model: str, engine: "AsyncEngine | ReplicaSet") -> None:
        self.model = model
        self.engine = engine

    def sources(self) -> tuple[list[str], list[_Source]]:
        """The label names, and a row per series: with replicas, the total (replica="", i.e. no
        label to Prometheus) and then one per replica."""
        e = self.engine
        if isinstance(e, DisaggregatedSet):  # a row per role (prefill, decode) beside the total (role="")
            rows = [_Source((self.model, ""), e.snapshot, e.num_waiting)]
            rows += [_Source((self.model, role), total_snapshot(e.engine_snapshots(role)),
                             sum(x.num_waiting for x in e.engines[role]), any(e.engine_up(role)))
                     for role in ROLES]
            return ["model_name", "role"], rows
        if not isinstance(e, ReplicaSet):
            return ["model_name"], [_Source((self.model,), e.snapshot, e.num_waiting)]
        up = e.replica_up()
        rows = [_Source((self.model, ""), e.snapshot, e.num_waiting)]
        rows += [_Source((self.model, str(i)), snap, r.num_waiting, up[i])
                 for i, (r, snap) in enumerate(zip(e.replicas, e.replica_snapshots()))]
        return ["model_name", "replica"], rows

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        names, rows = self.sources()

        def metric(kind: type, name: str, doc: str, value: Callable[[_Source], float | None]):
            m = kind(PREFIX + name, doc, labels=names)
            for row in rows:
                v = value(row)
                if v is not None:
                    m.add_metric(list(row.labels), v)
            return m

        def snap(field: str) -> Callable[[_Source], float | None]:
            return lambda row: getattr(row.snapshot, field)

        if isinstance(self.engine, ReplicaSet):
            yield metric(GaugeMetricFamily, "replica_up", "Replicas serving (per replica: 1 serving, 0 failed or stopped).",
                         lambda row: sum(self.engine.replica_up()) if row.labels[-1] == "" else float(row.up))
        if isinstance(self.engine, DisaggregatedSet):
            yield from self._transfer_metrics(self.engine)
        yield metric(GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.", snap("num_running"))
        yield metric(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to run (admitted, not yet running).",
                     lambda row: row.num_waiting)
        yield metric(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                     lambda row: row.snapshot.kv_usage)
        yield metric(GaugeMetricFamily, "kv_cache_used_blocks", "KV-cache blocks in use.",
                     lambda row: row.snapshot.num_blocks - row.snapshot.num_free_blocks)
        yield metric(GaugeMetricFamily, "kv_cache_total_blocks", "KV-cache blocks in the pool.", snap("num_blocks"))
        yield metric(CounterMetricFamily, "num_preemptions", "Preemptions (sequences evicted to be recomputed).",
                     snap("num_preemptions"))
        yield metric(CounterMetricFamily, "prompt_tokens", "Prompt tokens prefilled.", snap("prompt_tokens"))
        yield metric(CounterMetricFamily, "generation_tokens", "Tokens generated.", snap("generation_tokens"))
        yield metric(CounterMetricFamily, "engine_steps", "Engine steps run.", snap("num_steps"))
        yield metric(CounterMetricFamily, "engine_step_failures",
                     "Engine steps that raised (in the model or around it); their requests failed with an error.",
                     snap("num_step_failures"))
        if any(row.snapshot.prefix_cache_queries is not None for row in rows):
            yield metric(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                         snap("prefix_cache_queries"))
        if any(row.snapshot.prefix_cache_hits is not None for row in rows):
            yield metric(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                         snap("prefix_cache_hits"))
        if any(row.snapshot.host_kv_total_blocks is not None for row in rows):
            yield from self._host_tier_metrics(names, rows)
        if any(row.snapshot.spec_draft_tokens is not None for row in rows):
            yield metric(CounterMetricFamily, "spec_decode_num_draft_tokens",
                         "Speculative decoding: draft tokens verified.", lambda row: row.snapshot.spec_draft_tokens or 0)
            yield metric(CounterMetricFamily, "spec_decode_num_accepted_tokens",
                         "Speculative decoding: draft tokens the model agreed with (kept).",
                         lambda row: row.snapshot.spec_accepted_tokens or 0)
            yield metric(CounterMetricFamily, "spec_decode_num_drafts",
                         "Speculative decoding: drafts verified (one sequence's draft in a step); the mean tokens a "
                         "draft keeps is 1 + accepted tokens / drafts.", lambda row: row.snapshot.spec_drafts or 0)

    def _host_tier_metrics(self, names: list[str], rows: list[_Source]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The host tier of the prefix cache (--kv-offload-gib): hits per tier, bytes each way, occupancy."""
        hits = CounterMetricFamily(PREFIX + "prefix_cache_tier_hits", "Prompt tokens found in the prefix cache, "
                                   "by tier (device: GPU blocks reused; host: copied back from host memory).",
                                   labels=[*names, "tier"])
        moved = CounterMetricFamily(PREFIX + "kv_offload_bytes", "KV bytes copied between the device pool and the "
                                    "host tier, by direction (out: device to host; in: host to device).",
                                    labels=[*names, "direction"])
        used = GaugeMetricFamily(PREFIX + "host_kv_cache_used_blocks", "Host-tier KV blocks holding a block.",
                                 labels=names)
        total = GaugeMetricFamily(PREFIX + "host_kv_cache_total_blocks", "KV blocks the host tier holds.", labels=names)
        for row in rows:
            s, labels = row.snapshot, list(row.labels)
            if s.host_kv_total_blocks is None:
                continue
            host_hits = s.prefix_cache_host_hits or 0
            hits.add_metric([*labels, "device"], (s.prefix_cache_hits or 0) - host_hits)
            hits.add_metric([*labels, "host"], host_hits)
            moved.add_metric([*labels, "out"], s.kv_offload_bytes_out or 0)
            moved.add_metric([*labels, "in"], s.kv_offload_bytes_in or 0)
            used.add_metric(labels, s.host_kv_used_blocks or 0)
            total.add_metric(labels, s.host_kv_total_blocks)
        yield from (hits, moved, used, total)


    def _transfer_metrics(self, e: DisaggregatedSet) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(PREFIX + "engine_up", "Engines serving, per role (prefill, decode).",
                               labels=["model_name", "role"])
        for role in ROLES:
            up.add_metric([self.model, role], sum(e.engine_up(role)))
        yield up
        t = e.transfers
        for name, doc, value in (("kv_transfers", "Prompts whose KV moved from a prefill to a decode engine.",
                                  t.num_transfers),
                                 ("kv_transfer_bytes", "KV bytes moved from prefill to decode engines.", t.num_bytes),
                                 ("kv_transfer_timed_bytes", "The bytes of the transfers kv_transfer_seconds observed.",
                                  t.timed_bytes)):
            m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            m.add_metric([self.model], value)
            yield m


class Metrics:
    """The app's registry; also the AsyncEngine's (or ReplicaSet's) LoopObserver (it attaches itself).
    With replicas every series comes per replica (label replica="0", "1", ...) and for the whole
    server (replica="", which Prometheus stores without the label: select it with {replica=""})."""

    def __init__(self, model: str, engine: "AsyncEngine | ReplicaSet", api_process: int | None = None) -> None:
        """api_process: this process's index among several API processes (serve/api_processes.py)."""
        self.model = model
        self.replicated = isinstance(engine, ReplicaSet)
        self.registry = CollectorRegistry()
        collector = _EngineCollector(model, engine)
        self.registry.register(collector)
        engine.observer = self
        r, m = self.registry, ["model_name", "replica"] if self.replicated else ["model_name"]
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
                                ["model_name", "reason"], registry=r)
        if isinstance(engine, DisaggregatedSet):
            transfer = Histogram(PREFIX + "kv_transfer_seconds", "Time to receive one prompt's KV on a decode engine "
                                 "(observed once its bytes arrived, on a GPU by CUDA events).",
                                 ["model_name"], buckets=LATENCY_BUCKETS, registry=r)

            def observe(got: Received) -> None:
                for _, seconds in got.timed:
                    transfer.labels(self.model).observe(seconds)

            engine.on_transfer = observe
        self.http = Counter(PREFIX + "http_requests", "HTTP responses by path and status.", ["path", "status"], registry=r)
        # several API processes (serve/api_processes.py): the counters and histograms of all of them,
        # summed from their files, beside this process's view of the engine
        self.shared: CollectorRegistry | None = None
        self.by_process: Counter | None = None
        shared_dir = os.environ.get(METRICS_DIR_ENV)
        if shared_dir:
            self.shared = CollectorRegistry()
            MultiProcessCollector(self.shared, shared_dir)
            self.shared.register(collector)
            if api_process is not None:
                self.by_process = Counter(PREFIX + "api_process_http_requests", "HTTP responses by the API process "
                                          "that served them.", ["api_process"], registry=r).labels(str(api_process))

    # LoopObserver
    def request_finished(self, rec: RequestRecord, replica: int | None = None) -> None:
        if not self.replicated:
            self._observe(rec, (self.model,))
            return
        self._observe(rec, (self.model, ""))
        if replica is not None:
            self._observe(rec, (self.model, str(replica)))

    def _observe(self, rec: RequestRecord, labels: tuple[str, ...]) -> None:
        self.finished.labels(*labels, rec.finish_reason or "unknown").inc()
        self.prompt_len.labels(*labels).observe(rec.num_prompt_tokens)
        self.output_len.labels(*labels).observe(rec.num_output_tokens)
        if rec.finish is not None:
            self.e2e.labels(*labels).observe(rec.finish - rec.arrival)
        if rec.first_token is not None:
            self.ttft.labels(*labels).observe(rec.first_token - rec.arrival)
            if rec.finish is not None and rec.num_output_tokens > 1:
                self.tpot.labels(*labels).observe((rec.finish - rec.first_token) / (rec.num_output_tokens - 1))

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry if self.shared is None else self.shared))


class _WithoutCreated:
    """The registry's metrics less prometheus_client's `*_created` series (each counter's and
    histogram's creation time), which double every series and which no dashboard of ours reads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


RECEIVED = "pagedserve.received"  # scope key: when the request came in (time.monotonic()), for the API trace


class HttpMetricsMiddleware:
    """Counts responses by path and status (unknown paths share one label, to bound cardinality), and
    stamps each request's scope with the time it came in (RECEIVED)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RECEIVED] = time.monotonic()
        path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(path, str(message["status"])).inc()
                if self.metrics.by_process is not None:
                    self.metrics.by_process.inc()
            await send(message)

        await self.app(scope, receive, counting_send)
