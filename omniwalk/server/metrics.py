"""Prometheus metrics of one app, in a registry of its own (several apps can live in one process).

Every series carries a `model_name` label: the first served name (as vLLM labels its
series), so one dashboard can chart several servers. Two kinds of values:

* per-request events, recorded by the server as chunks reach it: requests by outcome,
  prompt and generated token counts, time to first token, time per output token and
  end-to-end latency; on a speech model, or one that speaks its chat answers, the audio's
  SLOs (time to first audio, real-time factor, audio seconds out); on a transcription model
  the audio seconds in and each request's real-time factor;
* engine state, read at scrape time by a collector: waiting and running requests,
  requests in flight, KV cache pages used and free, engine steps and preemptions (the
  loop's last `LoopStats`, which the engine process sends with each step's outputs).

With `omniwalk serve --api-server-count N` a scrape reaches one of the N API processes,
so the per-request series are summed over all of them (prometheus_client's multiprocess
mode: each process keeps its values in files under PROMETHEUS_MULTIPROC_DIR, which the
supervisor makes, and a scrape adds them up); the engine's state is the one engine's,
except `omniwalk_num_requests_in_flight`: the answering API process's own.

Definitions (measured at the server, on the asyncio side, when a chunk arrives):

    TTFT  = time the first token ids reached the server - time the HTTP request was accepted
    TPOT  = (time of the last token - time of the first token) / (output tokens - 1),
            one observation per request with at least two output tokens
    e2e   = time of the final record - time the HTTP request was accepted
    TTFA  = time the first audio samples reached the server - time the HTTP request was accepted
    speech RTF        = e2e / seconds of audio the request produced (below 1: faster than real time)
    transcription RTF = e2e / seconds of audio the request carried

Output tokens are the ids the engine produced (a stop id included), never re-tokenized text.
A speech request's output tokens are its audio codes.

`vllm_names=True` (`omniwalk serve --metrics-compat vllm`) also exports the same values
under the `vllm:` names dashboards built for vLLM read (VLLM_NAMES); the omniwalk names stay.
They keep omniwalk's definitions above: `vllm:time_per_output_token_seconds` is TPOT, one
observation per request, where vLLM observes every gap between two tokens.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omniwalk.api import Engine
from omniwalk.capabilities import Capability, capability_of

OUTCOMES = ("length", "stop", "abort", "error", "rejected", "invalid")
FINISH_REASONS = ("length", "stop", "abort", "error")   # outcomes of requests that ran
METRICS_COMPAT = ("vllm",)                              # the choices of --metrics-compat
#: set (before prometheus_client is imported): the per-request series of every process
#: writing there are summed at each scrape (several API processes)
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_RTF_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)

#: omniwalk name -> the vLLM name of the same value (exported as well under --metrics-compat vllm)
VLLM_NAMES = {
    "omniwalk_prompt_tokens": "vllm:prompt_tokens",
    "omniwalk_generation_tokens": "vllm:generation_tokens",
    "omniwalk_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "omniwalk_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    "omniwalk_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "omniwalk_num_requests_waiting": "vllm:num_requests_waiting",
    "omniwalk_num_requests_running": "vllm:num_requests_running",
    "omniwalk_preemptions": "vllm:num_preemptions",
}
#: vLLM's KV cache gauge (a fraction, 1 = full), under its old and its current name
VLLM_KV_USAGE_NAMES = ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")


class _Series:
    """One measured value exported under one or more metric names (each a labelled child)."""

    def __init__(self, children: list):
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for child in self.children:
            child.inc(amount)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Engine, model_name: str = "", vllm_names: bool = False):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.vllm_names = vllm_names
        # running totals, for the periodic stats line (stats_log.py): Counter values are not public
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.total_audio_samples_out = 0   # as the chunks arrive (the stats line's audio rate)
        self._requests = Counter("omniwalk_requests", "Requests by outcome: a finish reason (length, stop, "
                                 "abort, error), rejected (429) or invalid (4xx)", ["model_name", "outcome"],
                                 registry=self.registry)
        for outcome in OUTCOMES:   # export zeros, so a dashboard sees every series from the start
            self._requests.labels(model_name, outcome)
        self._vllm_finished = None
        if vllm_names:
            self._vllm_finished = Counter("vllm:request_success", "Finished requests by finish reason",
                                          ["model_name", "finished_reason"], registry=self.registry)
            for reason in FINISH_REASONS:
                self._vllm_finished.labels(model_name, reason)
        self.prompt_tokens = self._counter("omniwalk_prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = self._counter("omniwalk_generation_tokens", "Output token ids sent to clients")
        self.ttft = self._histogram("omniwalk_time_to_first_token_seconds", "Request accepted -> first token ids",
                                    _LATENCY_BUCKETS)
        self.tpot = self._histogram("omniwalk_time_per_output_token_seconds",
                                    "(last token - first token) / (output tokens - 1), per request", _TPOT_BUCKETS)
        self.e2e = self._histogram("omniwalk_e2e_request_latency_seconds", "Request accepted -> final record",
                                   _LATENCY_BUCKETS)
        self._add_audio_series(engine)
        engine_state = _EngineCollector(engine, model_name, vllm_names)
        self.registry.register(engine_state)
        self._summed: tuple[CollectorRegistry, CollectorRegistry] | None = None
        if os.environ.get(MULTIPROCESS_DIR_ENV):
            from prometheus_client.multiprocess import MultiProcessCollector

            every_process, engine_only = CollectorRegistry(), CollectorRegistry()
            MultiProcessCollector(every_process)
            engine_only.register(engine_state)
            self._summed = (every_process, engine_only)

    def _add_audio_series(self, engine: Engine) -> None:
        """The audio SLOs, on models that produce or take audio only (a text model has none)."""
        capabilities = engine.capabilities
        self.ttfa = self.speech_rtf = self.audio_output_seconds = None
        self.audio_input_seconds = self.transcription_rtf = None
        # a model that speaks its chat answers (Qwen3-Omni) has the speech series too
        speaking = engine.frontend(Capability.TEXT) if Capability.TEXT in capabilities else None
        if Capability.SPEECH in capabilities or (speaking is not None and speaking.voices):
            self.speech_sampling_rate = (engine.frontend(Capability.SPEECH).sampling_rate
                                         if Capability.SPEECH in capabilities else speaking.audio_sample_rate)
            self.ttfa = self._histogram("omniwalk_time_to_first_audio_seconds",
                                        "Request accepted -> first audio samples", _LATENCY_BUCKETS)
            self.speech_rtf = self._histogram("omniwalk_audio_real_time_factor",
                                              "Speech: e2e latency / seconds of audio produced, per request",
                                              _RTF_BUCKETS)
            self.audio_output_seconds = self._counter("omniwalk_audio_output_seconds", "Seconds of audio produced")
        if Capability.TRANSCRIPTION in capabilities:
            self.audio_input_seconds = self._counter("omniwalk_audio_input_seconds",
                                                     "Seconds of audio received for transcription")
            self.transcription_rtf = self._histogram("omniwalk_transcription_real_time_factor",
                                                     "Transcription: e2e latency / seconds of audio received, "
                                                     "per request", _RTF_BUCKETS)

    def _names(self, name: str) -> list[str]:
        vllm = VLLM_NAMES.get(name) if self.vllm_names else None
        return [name, vllm] if vllm else [name]

    def _counter(self, name: str, documentation: str) -> _Series:
        return _Series([Counter(n, documentation, ["model_name"], registry=self.registry).labels(self.model_name)
                        for n in self._names(name)])

    def _histogram(self, name: str, documentation: str, buckets) -> _Series:
        return _Series([Histogram(n, documentation, ["model_name"], buckets=buckets, registry=self.registry)
                        .labels(self.model_name) for n in self._names(name)])

    def render(self) -> bytes:
        if self._summed is None:
            return generate_latest(self.registry)
        every_process, engine_only = self._summed
        return generate_latest(every_process) + generate_latest(engine_only)

    def count(self, outcome: str) -> None:
        self._requests.labels(self.model_name, outcome).inc()
        if self._vllm_finished is not None and outcome in FINISH_REASONS:
            self._vllm_finished.labels(self.model_name, outcome).inc()

    def count_prompt_tokens(self, n: int) -> None:
        self.total_prompt_tokens += n
        self.prompt_tokens.inc(n)

    def count_generation_tokens(self, n: int) -> None:
        self.total_generation_tokens += n
        self.generation_tokens.inc(n)

    def track(self, request, num_prompt_tokens: int, start: float) -> "RequestRecord":
        """The record of one engine request (`request`: a GenerationRequest, SpeechRequest, ...)."""
        record_type = {Capability.SPEECH: SpeechRecord,
                       Capability.TRANSCRIPTION: TranscriptionRecord}.get(capability_of(type(request)), RequestRecord)
        if getattr(request, "speech", None) is not None:   # a chat answer spoken as well
            record_type = SpokenAnswerRecord
        return record_type(self, num_prompt_tokens, start)


class RequestRecord:
    """The metrics of one engine request, fed with its chunks as the server receives them."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, start: float):
        self.metrics = metrics
        self.start = start
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_output_tokens = 0
        self.done = False
        metrics.count_prompt_tokens(num_prompt_tokens)

    def on_chunk(self, chunk) -> None:
        now = time.monotonic()
        if chunk.token_ids:
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.start)
            self.last_token = now
            self.num_output_tokens += len(chunk.token_ids)
            self.metrics.count_generation_tokens(len(chunk.token_ids))
        self.on_output(chunk, now)
        if chunk.finished:
            self.finish(chunk.finish_reason or "error", chunk)

    def on_output(self, chunk, now: float) -> None:
        """What a capability measures besides tokens (audio)."""

    def finish(self, outcome: str, last_chunk=None) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.count(outcome)
        e2e = time.monotonic() - self.start
        self.metrics.e2e.observe(e2e)
        if self.num_output_tokens > 1:
            self.metrics.tpot.observe((self.last_token - self.first_token) / (self.num_output_tokens - 1))
        if outcome in ("length", "stop"):
            self.on_completed(e2e, last_chunk)

    def on_completed(self, e2e: float, last_chunk) -> None:
        """A request that produced all it was asked for (finish reason length or stop)."""


class SpeechRecord(RequestRecord):
    """A text-to-speech request: time to first audio, audio seconds out, real-time factor."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, start: float):
        super().__init__(metrics, num_prompt_tokens, start)
        self.num_samples = 0

    def on_output(self, chunk, now: float) -> None:
        pcm = self.audio_of(chunk)
        if pcm:
            if self.num_samples == 0:
                self.metrics.ttfa.observe(now - self.start)
            self.num_samples += len(pcm) // 2   # int16 mono
            self.metrics.total_audio_samples_out += len(pcm) // 2

    def audio_of(self, chunk) -> bytes:
        return chunk.pcm

    def on_completed(self, e2e: float, last_chunk) -> None:
        seconds = self.num_samples / self.metrics.speech_sampling_rate
        self.metrics.audio_output_seconds.inc(seconds)
        if seconds > 0:
            self.metrics.speech_rtf.observe(e2e / seconds)


class SpokenAnswerRecord(SpeechRecord):
    """A chat answer in text and audio: a text request's figures and a speech request's."""

    def audio_of(self, chunk) -> bytes:
        return chunk.audio


class TranscriptionRecord(RequestRecord):
    """A transcription: audio seconds in (from the final usage), real-time factor."""

    def on_completed(self, e2e: float, last_chunk) -> None:
        usage = getattr(last_chunk, "usage", None)
        if usage is None or usage.audio_seconds <= 0:
            return
        self.metrics.audio_input_seconds.inc(usage.audio_seconds)
        self.metrics.transcription_rtf.observe(e2e / usage.audio_seconds)


class _EngineCollector:
    """Engine state read at scrape time: the loop's last published `LoopStats`."""

    def __init__(self, engine: Engine, model_name: str, vllm_names: bool):
        self.engine = engine
        self.model_name = model_name
        self.vllm_names = vllm_names

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
            usage = stats.kv_pages_used / stats.kv_pages_total
            gauges += [
                ("omniwalk_kv_cache_pages_used", "KV cache pages in use", stats.kv_pages_used),
                ("omniwalk_kv_cache_pages_free", "KV cache pages free", stats.kv_pages_total - stats.kv_pages_used),
                ("omniwalk_kv_cache_usage_ratio", "Fraction of KV cache pages in use", usage),
            ]
            if self.vllm_names:
                gauges += [(name, "KV cache usage (1 = full)", usage) for name in VLLM_KV_USAGE_NAMES]
        for name, documentation, value in gauges:
            yield from self._families(GaugeMetricFamily, name, documentation, value)
        yield from self._families(CounterMetricFamily, "omniwalk_engine_steps", "Engine loop steps", stats.steps)
        yield from self._families(CounterMetricFamily, "omniwalk_preemptions", "Streams preempted for KV cache space",
                                  stats.num_preemptions)

    def _families(self, family_type, name: str, documentation: str, value: float):
        """`name` (and its vLLM name, when asked for), labelled with the model name."""
        vllm = VLLM_NAMES.get(name) if self.vllm_names else None
        for metric_name in [name, vllm] if vllm else [name]:
            family = family_type(metric_name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
