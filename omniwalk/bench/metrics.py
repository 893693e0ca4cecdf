"""Latency and throughput of one run, from its request records.

Each definition below is printed with every summary and written into the JSON, so a
figure never travels without what it means. Percentiles are numpy's (linear
interpolation between the closest ranks).

Per request, from its arrivals (chunks that carried output) at times a_1 < a_2 < ... < a_k,
chunk i carrying n_i ids, sent at s and complete at e:

    TTFT  = a_1 - s
    E2E   = e - s
    TPOT  = (E2E - TTFT) / (N - 1),  N = n_1 + ... + n_k          (N >= 2 only)
    ITL per token: for i >= 2, n_i samples of (a_i - a_{i-1}) / n_i
    ITL per chunk: for i >= 2, one sample of a_i - a_{i-1}

TTFT, TPOT and E2E are one sample per request; ITL samples are pooled over requests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from omniwalk.bench.backends import RequestRecord

PERCENTILES = (50, 90, 99)
OUTPUT_REASONS = ("length", "stop")
MAX_LISTED_FAILURES = 20

DEFINITIONS = {
    "TTFT": "time to first token: request sent -> first response chunk carrying an output id",
    "TPOT": "time per output token, per request: (E2E - TTFT) / (output ids - 1); requests with "
            "one output id have none",
    "ITL per token": "inter-token latency: each chunk's gap since the previous chunk that carried "
                     "ids, divided evenly over the ids it carried (the first chunk's ids have none)",
    "ITL per chunk": "the gap between consecutive chunks that carried ids, whatever their number: "
                     "per CHUNK, not per token",
    "E2E": "end-to-end latency: request sent -> response complete (the final record; over HTTP, "
           "`data: [DONE]`)",
    "throughput": "completed requests, their output ids and their prompt tokens divided by the "
                  "duration: first request sent -> last request complete (warmup excluded)",
    "audio s / s": "with --audio-seconds: the input audio of completed requests (seconds) divided by "
                   "the duration, as the throughputs",
    "output ids": "counted from the token ids the server returned, never from re-tokenized text; "
                  "a server that returns none is counted from usage.completion_tokens (or chunks) "
                  "and the run is labelled NOT id-based",
    "failed": "HTTP status other than 200, a transport error, an error event, a finish_reason "
              "other than length/stop, or a budget violation: more output ids than max_tokens, "
              "or fewer with ignore_eos (or with finish_reason length). Latency figures cover "
              "completed requests only",
    "server-side TTFT": "over HTTP to an omniwalk server (`server_ttft` in the JSON): the mean of the "
                        "server's own TTFT (request accepted -> first token ids at the API process, "
                        "its /metrics read before and after the run), warm-up requests included",
}


@dataclass(frozen=True)
class Stats:
    """mean and percentiles of one figure (seconds); None when there are no samples."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values) -> "Stats":
        values = np.asarray(list(values), dtype=np.float64)
        if values.size == 0:
            return cls(0)
        p50, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(int(values.size), float(values.mean()), p50, p90, p99)

    def in_ms(self) -> dict:
        scale = lambda v: None if v is None else v * 1e3   # noqa: E731
        return {"count": self.count, "mean": scale(self.mean), "p50": scale(self.p50),
                "p90": scale(self.p90), "p99": scale(self.p99)}


# ----------------------------------------------------------------------------- per request


def output_arrivals(record: RequestRecord) -> list[tuple[float, int | None]]:
    """The chunks that carried output (ids, or text when the server sends no ids)."""
    return [(t, n) for t, n in record.arrivals if n is None or n > 0]


def ttft(record: RequestRecord) -> float | None:
    arrivals = output_arrivals(record)
    return arrivals[0][0] - record.send_time if arrivals else None


def e2e(record: RequestRecord) -> float | None:
    return None if record.end_time is None else record.end_time - record.send_time


def tpot(record: RequestRecord) -> float | None:
    first, total, count = ttft(record), e2e(record), record.output_tokens
    if first is None or total is None or count < 2:
        return None
    return (total - first) / (count - 1)


def itl_per_token(record: RequestRecord) -> list[float] | None:
    """None when the server sent no ids (the number of tokens per chunk is unknown)."""
    if not record.id_based:
        return None
    arrivals = output_arrivals(record)
    samples = []
    for (previous, _), (arrived, count) in zip(arrivals, arrivals[1:]):
        samples += [(arrived - previous) / count] * count
    return samples


def itl_per_chunk(record: RequestRecord) -> list[float]:
    times = [t for t, _ in output_arrivals(record)]
    return [b - a for a, b in zip(times, times[1:])]


def failure(record: RequestRecord, ignore_eos: bool) -> tuple[str, str] | None:
    """("error" | "budget", what went wrong), or None for a request that completed as asked."""
    if record.error is not None:
        return "error", record.error
    if record.finish_reason not in OUTPUT_REASONS:
        return "error", f"finish_reason {record.finish_reason}"
    if record.count_source == "chunks":   # the number of ids is unknown: nothing to check
        return None
    count, asked = record.output_tokens, record.requested_output_len
    if count > asked:
        return "budget", f"{count} output ids for max_tokens={asked}"
    if count < asked and (ignore_eos or record.finish_reason == "length"):
        why = "ignore_eos" if ignore_eos else "finish_reason length"
        return "budget", f"{count} of {asked} output ids with {why}"
    return None


# ----------------------------------------------------------------------------- per run


@dataclass
class RunSummary:
    """The figures of one measured phase. Latencies in seconds (`to_dict` gives ms)."""

    num_requests: int
    num_completed: int
    num_errors: int
    num_budget_violations: int
    duration_s: float
    prompt_tokens: int                 # of completed requests
    output_tokens: int                 # of completed requests
    output_tokens_received: int        # of every request, failed ones included
    requested_output_tokens: int       # the sum of max_tokens over every request sent
    count_source: str                  # "ids", or what the counts came from instead
    request_throughput: float
    output_throughput: float
    input_throughput: float
    audio_seconds: float | None        # input audio of completed requests; None: no request carried audio
    audio_seconds_per_s: float | None  # audio_seconds / duration_s
    ttft: Stats
    tpot: Stats
    itl_per_token: Stats | None        # None: not measurable (the server sent no ids)
    itl_per_chunk: Stats
    e2e: Stats
    failures: list[dict] = field(default_factory=list)   # the first MAX_LISTED_FAILURES

    @property
    def num_failed(self) -> int:
        return self.num_errors + self.num_budget_violations

    @property
    def id_based(self) -> bool:
        return self.count_source == "ids"

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items()
               if k not in ("ttft", "tpot", "itl_per_token", "itl_per_chunk", "e2e")}
        out["num_failed"] = self.num_failed
        out["id_based"] = self.id_based
        out["latency_ms"] = {
            "ttft": self.ttft.in_ms(), "tpot": self.tpot.in_ms(),
            "itl_per_token": None if self.itl_per_token is None else self.itl_per_token.in_ms(),
            "itl_per_chunk": self.itl_per_chunk.in_ms(), "e2e": self.e2e.in_ms(),
        }
        return out


def split_failures(records, find_failure, details):
    """(completed, listed failures, error count, budget-violation count) of a run's records.

    `find_failure(record)` returns None or (kind, message); `details(record)` adds fields
    to a listed failure."""
    completed, failures, errors, violations = [], [], 0, 0
    for record in records:
        problem = find_failure(record)
        if problem is None:
            completed.append(record)
            continue
        kind, message = problem
        errors += kind == "error"
        violations += kind == "budget"
        if len(failures) < MAX_LISTED_FAILURES:
            failures.append({"index": record.index, "kind": kind, "message": message,
                             "http_status": record.http_status, "finish_reason": record.finish_reason,
                             **details(record)})
    return completed, failures, errors, violations


def summarize(records: list[RequestRecord], start: float, end: float, ignore_eos: bool) -> RunSummary:
    completed, failures, errors, violations = split_failures(
        records, lambda r: failure(r, ignore_eos),
        lambda r: {"output_tokens": r.output_tokens, "max_tokens": r.requested_output_len})
    duration = max(end - start, 0.0)
    rate = (lambda amount: amount / duration) if duration > 0 else (lambda amount: 0.0)
    prompt_tokens = sum(r.prompt_len for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)
    audio_seconds = sum(r.audio_seconds for r in completed) if any(r.audio_seconds for r in records) else None
    itl_samples = [itl_per_token(r) for r in completed]
    return RunSummary(
        num_requests=len(records), num_completed=len(completed), num_errors=errors,
        num_budget_violations=violations, duration_s=duration,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        output_tokens_received=sum(r.output_tokens for r in records),
        requested_output_tokens=sum(r.requested_output_len for r in records),
        count_source=_count_source(records),
        request_throughput=rate(len(completed)), output_throughput=rate(output_tokens),
        input_throughput=rate(prompt_tokens),
        audio_seconds=audio_seconds, audio_seconds_per_s=None if audio_seconds is None else rate(audio_seconds),
        ttft=Stats.of(v for v in map(ttft, completed) if v is not None),
        tpot=Stats.of(v for v in map(tpot, completed) if v is not None),
        itl_per_token=None if any(s is None for s in itl_samples)
        else Stats.of(x for samples in itl_samples for x in samples),
        itl_per_chunk=Stats.of(x for r in completed for x in itl_per_chunk(r)),
        e2e=Stats.of(v for v in map(e2e, completed) if v is not None),
        failures=failures,
    )


def _count_source(records: list[RequestRecord]) -> str:
    sources = sorted({r.count_source for r in records if r.arrivals})
    if sources in ([], ["ids"]):
        return "ids"
    names = {"usage": "usage.completion_tokens", "chunks": "number of chunks"}
    return " + ".join(names.get(s, s) for s in sources) + " (NOT id-based)"


def summary_header(title: str, s) -> list[str]:
    """The first lines of every mode's summary: the title rule, the requests and their
    failures, the phase's duration (`s`: any mode's summary)."""
    return [
        f"==== {title} " + "=" * max(0, 74 - len(title)),
        f"  requests              {s.num_requests} sent, {s.num_completed} completed, {s.num_failed} failed "
        f"({s.num_errors} errors, {s.num_budget_violations} budget violations)",
        f"  duration              {s.duration_s:.3f} s",
    ]
