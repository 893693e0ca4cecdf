"""Figures of one `omniwalk bench --speak` run (chat answered in text and audio), from its
`SpokenChatRecord`s.

The text side has the text mode's figures (metrics.py: TTFT, TPOT, output tok/s) and the
audio side the TTS mode's (tts_metrics.py: time to first audio, RTF, audio throughput,
streaming viability, stall), each computed by that mode's own per-request functions on
the record's `text` and `audio` views. A request counts as completed only when both sides
are as asked; the figures cover completed requests only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from omniwalk.bench import metrics, tts_metrics
from omniwalk.bench.metrics import Stats, split_failures, summary_header
from omniwalk.bench.speak_backends import SpokenChatRecord
from omniwalk.bench.tts_metrics import latency_row

SPEAK_DEFINITIONS = {
    "TTFT": "time to first token: request sent -> first response chunk carrying a text id",
    "TPOT": "time per output token of the text, per request: (last text id's arrival - first text id's) / "
            "(text ids - 1); requests with one text id have none. The audio goes on after the text",
    "TTFA": "time to first audio: request sent -> first response chunk carrying audio samples",
    "E2E": "request sent -> the response complete (in-process: the finished chunk; over HTTP: "
           "`data: [DONE]`): the text and all of its audio",
    "audio seconds": "samples received / 24000 (16-bit mono PCM deltas), counted from the audio bytes; "
                     "on Qwen3-Omni F frames are F * 1920 - 555 samples",
    "RTF": tts_metrics.TTS_DEFINITIONS["RTF"],
    "audio throughput": tts_metrics.TTS_DEFINITIONS["audio throughput"],
    "output throughput": "text ids of completed requests / run duration",
    "streaming viable": tts_metrics.TTS_DEFINITIONS["streaming viable"],
    "stall": tts_metrics.TTS_DEFINITIONS["stall"],
    "text ids": metrics.DEFINITIONS["output ids"],
    "failed": "HTTP status other than 200, a transport error, an error event, a finish_reason other "
              "than length/stop, or a budget violation: more text ids than max_tokens or fewer with "
              "ignore_eos (as the text mode); usage frames missing, more than max_frames, or fewer with "
              "ignore_eos (which ignores the codec's EOS as well as the text's); in-process, samples "
              "received != the model's samples for the usage's frames (a codec EOS that ended the audio "
              "counts as a frame, as a stopping EOS counts among the text ids, and is not heard). "
              "Latency figures cover completed requests only",
}


# ----------------------------------------------------------------------------- per request


def failure(record: SpokenChatRecord, ignore_eos: bool) -> tuple[str, str] | None:
    """("error" | "budget", what went wrong), or None for a request answered as asked."""
    text_problem = metrics.failure(record.text, ignore_eos)
    if text_problem is not None:
        return text_problem
    frames, asked = record.usage_frames, record.requested_frames
    if frames is None:
        return "error", "no audio frames in the usage"
    if frames > asked:
        return "budget", f"{frames} audio frames for max_frames={asked}"
    if frames < asked and ignore_eos:
        return "budget", f"{frames} of {asked} audio frames with ignore_eos"
    if record.expected_samples is not None and record.samples not in record.expected_samples:
        expected = " or ".join(map(str, record.expected_samples))
        return "budget", f"received {record.samples} samples; {frames} frames are {expected}"
    return None


# ----------------------------------------------------------------------------- per run


@dataclass
class SpeakSummary:
    """The figures of one measured phase. Latencies in seconds (`to_dict` gives ms)."""

    num_requests: int
    num_completed: int
    num_errors: int
    num_budget_violations: int
    duration_s: float
    prompt_tokens: int                 # of completed requests
    output_tokens: int                 # text ids of completed requests
    requested_output_tokens: int       # the sum of max_tokens over every request sent
    frames: int                        # audio frames of completed requests (usage)
    requested_frames: int              # the sum of max_frames over every request sent
    samples: int                       # samples received by completed requests
    samples_received: int              # by every request, failed ones included
    audio_seconds: float               # of completed requests
    request_throughput: float
    output_throughput: float           # text ids per second
    audio_throughput: float            # audio seconds per wall second
    num_with_audio: int                # completed requests that received audio
    num_viable: int
    viable_fraction: float | None      # num_viable / num_with_audio
    ttft: Stats
    tpot: Stats
    ttfa: Stats
    e2e: Stats
    rtf: Stats                         # unitless
    stall: Stats
    #: chunk index (from 0) -> stalled requests whose latest chunk it was: where streams stall
    stalled_chunks: dict[int, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)   # the first few (metrics.MAX_LISTED_FAILURES)

    @property
    def num_failed(self) -> int:
        return self.num_errors + self.num_budget_violations

    def to_dict(self) -> dict:
        latencies = ("ttft", "tpot", "ttfa", "e2e", "stall")
        out = {k: v for k, v in asdict(self).items() if k not in (*latencies, "rtf")}
        out["num_failed"] = self.num_failed
        out["latency_ms"] = {name: getattr(self, name).in_ms() for name in latencies}
        out["rtf"] = asdict(self.rtf)
        return out


def summarize_speak(records: list[SpokenChatRecord], start: float, end: float, ignore_eos: bool) -> SpeakSummary:
    completed, failures, errors, violations = split_failures(
        records, lambda r: failure(r, ignore_eos),
        lambda r: {"output_tokens": r.output_tokens, "max_tokens": r.requested_tokens,
                   "frames": r.usage_frames, "max_frames": r.requested_frames, "samples": r.samples})
    duration = max(end - start, 0.0)
    rate = (lambda amount: amount / duration) if duration > 0 else (lambda amount: 0.0)
    texts, audios = [r.text for r in completed], [r.audio for r in completed]
    with_audio = [a for a in audios if a.arrivals]
    output_tokens = sum(r.output_tokens for r in completed)
    audio_seconds = sum(a.audio_seconds for a in audios)
    viable = sum(bool(tts_metrics.is_viable(a)) for a in with_audio)

    def stats(figure, records) -> Stats:
        return Stats.of(v for v in map(figure, records) if v is not None)

    return SpeakSummary(
        num_requests=len(records), num_completed=len(completed), num_errors=errors,
        num_budget_violations=violations, duration_s=duration,
        prompt_tokens=sum(r.prompt_len for r in completed), output_tokens=output_tokens,
        requested_output_tokens=sum(r.requested_tokens for r in records),
        frames=sum(r.usage_frames for r in completed), requested_frames=sum(r.requested_frames for r in records),
        samples=sum(r.samples for r in completed), samples_received=sum(r.samples for r in records),
        audio_seconds=audio_seconds, request_throughput=rate(len(completed)),
        output_throughput=rate(output_tokens), audio_throughput=rate(audio_seconds),
        num_with_audio=len(with_audio), num_viable=viable,
        viable_fraction=viable / len(with_audio) if with_audio else None,
        ttft=stats(metrics.ttft, texts), tpot=stats(metrics.tpot, texts),
        ttfa=stats(tts_metrics.ttfa, with_audio), e2e=stats(tts_metrics.e2e, audios),
        rtf=stats(tts_metrics.rtf, with_audio), stall=stats(tts_metrics.stall, with_audio),
        stalled_chunks=dict(sorted(Counter(i for i in map(tts_metrics.latest_chunk, with_audio)
                                           if i is not None).items())),
        failures=failures,
    )


# ----------------------------------------------------------------------------- text


def format_speak_summary(title: str, s: SpeakSummary) -> str:
    viable = "-" if s.viable_fraction is None else f"{s.viable_fraction:.3f}"
    unitless = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
    lines = summary_header(title, s) + [
        f"  prompt tokens         {s.prompt_tokens}",
        f"  text ids              {s.output_tokens} ({s.requested_output_tokens} asked for)",
        f"  audio frames          {s.frames} ({s.requested_frames} asked for)",
        f"  audio received        {s.samples} samples = {s.audio_seconds:.3f} s; {s.samples_received} samples in all",
        f"  audio throughput      {s.audio_throughput:.3f} audio s per wall s (real-time streams sustained)",
        f"  output throughput     {s.output_throughput:.1f} text tok/s",
        f"  request throughput    {s.request_throughput:.2f} req/s",
        f"  streaming viable      {viable} ({s.num_viable} of {s.num_with_audio} requests with audio)",
        f"  {'latency (ms)':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'samples':>10}",
        latency_row("TTFT (text)", s.ttft),
        latency_row("TPOT (text)", s.tpot),
        latency_row("TTFA (audio)", s.ttfa),
        latency_row("E2E", s.e2e),
        latency_row("stall", s.stall, note="(0: viable)"),
        latency_row("RTF (E2E / audio)", s.rtf, scale=unitless, note="(< 1: faster than real time)"),
    ]
    if s.stalled_chunks:
        where = ", ".join(f"chunk {i}: {n}" for i, n in s.stalled_chunks.items())
        lines.append(f"  stalled at            {where} (each stalled request's latest chunk, from 0)")
    for item in s.failures[:5]:
        lines.append(f"  failed #{item['index']}: [{item['kind']}] {item['message']}")
    return "\n".join(lines)
