"""Prometheus metrics of one app, in a registry of its own (several apps can live in one process).

Two kinds of values:

* per-request events, recorded by the server as chunks reach it: requests by outcome,
  prompt and generated token counts, time to first token, time per output token and
  end-to-end latency;
* engine state, read at scrape time by a collector: waiting and running requests,
  requests in flight, KV cache pages used and free, engine steps and preemptions (the
  loop's last `LoopStats`, which the engine process sends with each step's outputs).

Definitions (measured at the server, on the asyncio side, when a chunk arrives):

    TTFT  = time the first token ids reached the server - time the HTTP request was accepted
    TPOT  = (time of the last token - time of the first token) / (output tokens - 1),
            one observation per request with at least two output tokens
    e2e   = time of the final record - time the HTTP request was accepted

Output tokens are the ids the engine produced (a stop id included), never re-tokenized text.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omniwalk.api import Engine, GenerationChunk

OUTCOMES = ("length", "stop", "abort", "error", "rejected", "invalid")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omniwalk_requests", "Requests by outcome: a finish reason (length, stop, "
                                "abort, error), rejected (429) or invalid (4xx)", ["outcome"], registry=r)
        for outcome in OUTCOMES:   # export zeros, so a dashboard sees every series from the start
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("omniwalk_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("omniwalk_generation_tokens", "Output token ids sent to clients",
                                         registry=r)
        self.ttft = Histogram("omniwalk_time_to_first_token_seconds", "Request accepted -> first token ids",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("omniwalk_time_per_output_token_seconds",
                              "(last token - first token) / (output tokens - 1), per request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("omniwalk_e2e_request_latency_seconds", "Request accepted -> final record",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def track(self, num_prompt_tokens: int, start: float) -> "RequestRecord":
        return RequestRecord(self, num_prompt_tokens, start)


class RequestRecord:
    """The metrics of one engine request, fed with its chunks as the server receives them."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, start: float):
        self.metrics = metrics
        self.start = start
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_output_tokens = 0
        self.done = False
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def on_chunk(self, chunk: GenerationChunk) -> None:
        now = time.monotonic()
        if chunk.token_ids:
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.start)
            self.last_token = now
            self.num_output_tokens += len(chunk.token_ids)
            self.metrics.generation_tokens.inc(len(chunk.token_ids))
        if chunk.finished:
            self.finish(chunk.finish_reason or "error")

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.count(outcome)
        self.metrics.e2e.observe(time.monotonic() - self.start)
        if self.num_output_tokens > 1:
            self.metrics.tpot.observe((self.last_token - self.first_token) / (self.num_output_tokens - 1))


class _EngineCollector:
    """Engine state read at scrape time: the loop's last published `LoopStats`."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        stats = engine.stats
        gauges = [
            ("omniwalk_num_requests_waiting", "Requests waiting for admission", stats.num_waiting),
            ("omniwalk_num_requests_running", "Requests admitted and running", stats.num_running),
            ("omniwalk_num_requests_in_flight", "Requests submitted and not finished", engine.num_in_flight),
            ("omniwalk_engine_alive", "1 while the engine loop runs", float(engine.is_alive)),
        ]
        if stats.kv_pages_total:   # the paged KV cache of the backbone
            gauges += [
                ("omniwalk_kv_cache_pages_used", "KV cache pages in use", stats.kv_pages_used),
                ("omniwalk_kv_cache_pages_free", "KV cache pages free", stats.kv_pages_total - stats.kv_pages_used),
                ("omniwalk_kv_cache_usage_ratio", "Fraction of KV cache pages in use",
                 stats.kv_pages_used / stats.kv_pages_total),
            ]
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        yield CounterMetricFamily("omniwalk_engine_steps", "Engine loop steps", value=stats.steps)
        yield CounterMetricFamily("omniwalk_preemptions", "Streams preempted for KV cache space",
                                  value=stats.num_preemptions)
