"""Text-to-speech figures of one run, from its `TTSRecord`s.

Every definition below is printed with each summary and written into the JSON. Per
request, sent at s, its audio chunks arriving at a_1 < a_2 < ... < a_k carrying d_1, ...,
d_k seconds of audio (samples / sample rate), its final record at e:

    TTFA    = a_1 - s                                    time to first audio
    E2E     = e - s
    audio   = d_1 + ... + d_k                            seconds of audio received
    RTF     = E2E / audio                                real-time factor: < 1 is faster than
                                                         real time (requests with audio only)
    viable  = for every i: a_i <= a_1 + d_1 + ... + d_{i-1}
              playback starts when the first chunk arrives; each later chunk must arrive
              before the audio received so far has finished playing (no stall)
    stall   = max(0, max_i a_i - (a_1 + d_1 + ... + d_{i-1}))    0 for a viable request

Per run: audio throughput = the audio seconds of completed requests / the duration (first
request sent -> last request complete): how many real-time streams the server sustained.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from omniwalk.bench.metrics import OUTPUT_REASONS, Stats, split_failures, summary_header
from omniwalk.bench.tts_backends import TTSRecord

TTS_DEFINITIONS = {
    "TTFA": "time to first audio: request sent -> first response chunk carrying audio samples",
    "E2E": "request sent -> final record (speech.audio.done; in-process: the finished chunk)",
    "audio seconds": "samples received / sample rate (24000 Hz over HTTP unless the server's "
                     "X-Sample-Rate says otherwise), counted from the audio bytes, not the usage",
    "RTF": "real-time factor, per request with audio: generation time (E2E) / audio seconds. "
           "< 1 is faster than real time",
    "audio throughput": "audio seconds of completed requests / run duration (first request sent -> "
                        "last request complete): audio seconds generated per wall second across all "
                        "streams, i.e. the number of real-time streams sustained",
    "streaming viable": "a request whose every audio chunk i arrives no later than first-audio time "
                        "+ the duration of chunks 1..i-1: played from its first chunk, it never stalls. "
                        "Reported as the fraction of completed requests with audio",
    "stall": "per request, how late its latest chunk was against that playback deadline (0 when viable)",
    "failed": "HTTP status other than 200, a transport error, an error event, a stream without its "
              "final record, a finish_reason other than length/stop, or a budget violation: more "
              "codes than max_output_tokens, fewer with ignore_eos (or finish_reason length), "
              "frames != codes // 7, or samples received != the usage's samples. Latency figures "
              "cover completed requests only",
}


# ----------------------------------------------------------------------------- per request


def ttfa(record: TTSRecord) -> float | None:
    return record.arrivals[0][0] - record.send_time if record.arrivals else None


def e2e(record: TTSRecord) -> float | None:
    return None if record.end_time is None else record.end_time - record.send_time


def rtf(record: TTSRecord) -> float | None:
    total, audio = e2e(record), record.audio_seconds
    return None if total is None or audio <= 0 else total / audio


def stall(record: TTSRecord) -> float | None:
    """How late the latest chunk was against its playback deadline; None without audio.

        chunk:        1        2             3
        arrives:      a_1      a_2           a_3
        deadline:     a_1      a_1 + d_1     a_1 + d_1 + d_2
    """
    if not record.arrivals:
        return None
    first = record.arrivals[0][0]
    played, worst = 0.0, 0.0
    for arrived, samples in record.arrivals:
        worst = max(worst, arrived - (first + played))
        played += samples / record.sample_rate
    return worst


def latest_chunk(record: TTSRecord) -> int | None:
    """The index (from 0) of the chunk that was latest against its playback deadline (the
    one `stall` measures) of a request that stalled; None for a viable one."""
    if not record.arrivals:
        return None
    first = record.arrivals[0][0]
    played, worst, index = 0.0, 0.0, None
    for i, (arrived, samples) in enumerate(record.arrivals):
        if arrived - (first + played) > worst:
            worst, index = arrived - (first + played), i
        played += samples / record.sample_rate
    return index


def is_viable(record: TTSRecord) -> bool | None:
    late = stall(record)
    return None if late is None else late <= 0.0


def failure(record: TTSRecord, ignore_eos: bool) -> tuple[str, str] | None:
    """("error" | "budget", what went wrong), or None for a request that completed as asked."""
    if record.error is not None:
        return "error", record.error
    if record.finish_reason not in OUTPUT_REASONS:
        return "error", f"finish_reason {record.finish_reason}"
    usage = record.usage or {}
    items, codes, frames, samples = (usage.get(k) for k in ("output_tokens", "codes", "frames", "samples"))
    if None in (items, codes, frames, samples):
        return "error", f"incomplete usage {usage}"
    asked = record.requested_codes
    if items > asked:
        return "budget", f"{items} output tokens for max_output_tokens={asked}"
    if items < asked and (ignore_eos or record.finish_reason == "length"):
        why = "ignore_eos" if ignore_eos else "finish_reason length"
        return "budget", f"{items} of {asked} output tokens with {why}"
    if frames > codes or (samples % frames if frames else samples):
        # how many codes make a frame is the model's; every frame decodes to the same samples
        return "budget", f"{frames} frames for {codes} codes and {samples} samples"
    if samples != record.samples:
        return "budget", f"received {record.samples} samples, the usage says {samples}"
    return None


# ----------------------------------------------------------------------------- per run


@dataclass
class TTSSummary:
    """The figures of one measured phase. Latencies in seconds (`to_dict` gives ms)."""

    num_requests: int
    num_completed: int
    num_errors: int
    num_budget_violations: int
    duration_s: float
    codes: int                         # audio codes of completed requests (usage)
    requested_codes: int               # the sum of max_output_tokens over every request sent
    samples: int                       # samples received by completed requests
    samples_received: int              # by every request, failed ones included
    audio_seconds: float               # of completed requests
    request_throughput: float
    audio_throughput: float            # audio seconds per wall second
    num_with_audio: int                # completed requests that received audio
    num_viable: int
    viable_fraction: float | None      # num_viable / num_with_audio
    ttfa: Stats
    e2e: Stats
    rtf: Stats                         # unitless
    stall: Stats
    failures: list[dict] = field(default_factory=list)   # the first few (metrics.MAX_LISTED_FAILURES)

    @property
    def num_failed(self) -> int:
        return self.num_errors + self.num_budget_violations

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("ttfa", "e2e", "rtf", "stall")}
        out["num_failed"] = self.num_failed
        out["latency_ms"] = {"ttfa": self.ttfa.in_ms(), "e2e": self.e2e.in_ms(), "stall": self.stall.in_ms()}
        out["rtf"] = asdict(self.rtf)
        return out


def summarize_tts(records: list[TTSRecord], start: float, end: float, ignore_eos: bool) -> TTSSummary:
    completed, failures, errors, violations = split_failures(
        records, lambda r: failure(r, ignore_eos),
        lambda r: {"samples": r.samples, "max_output_tokens": r.requested_codes})
    duration = max(end - start, 0.0)
    audio_seconds = sum(r.audio_seconds for r in completed)
    with_audio = [r for r in completed if r.arrivals]
    viable = sum(bool(is_viable(r)) for r in with_audio)
    return TTSSummary(
        num_requests=len(records), num_completed=len(completed), num_errors=errors,
        num_budget_violations=violations, duration_s=duration,
        codes=sum(r.usage["codes"] for r in completed),
        requested_codes=sum(r.requested_codes for r in records),
        samples=sum(r.samples for r in completed), samples_received=sum(r.samples for r in records),
        audio_seconds=audio_seconds,
        request_throughput=len(completed) / duration if duration > 0 else 0.0,
        audio_throughput=audio_seconds / duration if duration > 0 else 0.0,
        num_with_audio=len(with_audio), num_viable=viable,
        viable_fraction=viable / len(with_audio) if with_audio else None,
        ttfa=Stats.of(v for v in map(ttfa, completed) if v is not None),
        e2e=Stats.of(v for v in map(e2e, completed) if v is not None),
        rtf=Stats.of(v for v in map(rtf, completed) if v is not None),
        stall=Stats.of(v for v in map(stall, completed) if v is not None),
        failures=failures,
    )


# ----------------------------------------------------------------------------- text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def latency_row(name: str, stats: Stats, scale=_ms, note: str = "") -> str:
    """One row of a latency table: mean, p50, p90, p99, count (`scale`: how a value prints)."""
    cells = "".join(f"{scale(v):>10}" for v in (stats.mean, stats.p50, stats.p90, stats.p99))
    return f"  {name:<22}{cells}{stats.count:>10}  {note}".rstrip()


def format_tts_summary(title: str, s: TTSSummary) -> str:
    viable = "-" if s.viable_fraction is None else f"{s.viable_fraction:.3f}"
    lines = summary_header(title, s) + [
        f"  audio codes           {s.codes} ({s.requested_codes} asked for)",
        f"  audio received        {s.samples} samples = {s.audio_seconds:.3f} s; {s.samples_received} samples "
        f"in all",
        f"  audio throughput      {s.audio_throughput:.3f} audio s per wall s (real-time streams sustained)",
        f"  request throughput    {s.request_throughput:.2f} req/s",
        f"  streaming viable      {viable} ({s.num_viable} of {s.num_with_audio} requests with audio)",
        f"  {'latency (ms)':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'samples':>10}",
        latency_row("TTFA", s.ttfa),
        latency_row("E2E", s.e2e),
        latency_row("stall", s.stall, note="(0: viable)"),
        latency_row("RTF (E2E / audio)", s.rtf, scale=lambda v: "-" if v is None else f"{v:.3f}",
             note="(< 1: faster than real time)"),
    ]
    for item in s.failures[:5]:
        lines.append(f"  failed #{item['index']}: [{item['kind']}] {item['message']}")
    return "\n".join(lines)

