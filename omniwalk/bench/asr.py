"""`omniwalk bench --asr`: load a Whisper model, in-process or a server's (`--url`), with
synthetic clips and report requests/s and real-time factors.

    omniwalk bench --asr --model benchmarks/whisper-large-v3 --load-format dummy \\
        --concurrency 1,16,64 --num-requests 64 --audio-seconds 30 --output-len 200
    omniwalk bench --asr --url http://127.0.0.1:8000 --concurrency 1,16 --audio-seconds 30
        (each clip uploaded as a WAV to POST /v1/audio/transcriptions, stream=true)

Each request is one clip of `--audio-seconds` seconds of seeded synthetic audio (tones
and noise at 16 kHz) transcribed greedily with `max_output_tokens = --output-len`.
Closed loop: `--concurrency` requests in flight. Definitions (printed with the results):

  latency        request submitted -> final chunk (the transcript complete)
  TTFT           request submitted -> first chunk carrying transcript ids (over HTTP: the
                 first transcript.text.delta event, which carries text)
  request RTF    a request's latency / its audio duration (< 1: faster than real time)
  run RTF        the run's wall time / the audio seconds it transcribed
  audio s / s    audio seconds transcribed per wall second, all requests together
  output tokens  transcript ids the engine returned (no re-tokenization)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from omniwalk.bench.cli import _engine_args, parse_concurrency
from omniwalk.bench.report import exit_status, machine_info, now_iso, write_json
from omniwalk.bench.workload import SAMPLE_RATE, synthetic_clip

DEFAULT_ASR_SECONDS = 30.0

ASR_DEFINITIONS = {
    "latency": "request submitted -> final chunk (the transcript complete)",
    "ttft": "request submitted -> first chunk carrying transcript ids (over HTTP: the first text delta event)",
    "request_rtf": "a request's latency / its audio duration (< 1: faster than real time)",
    "run_rtf": "the run's wall time / the audio seconds it transcribed",
    "audio_seconds_per_second": "audio seconds transcribed per wall second, all requests together",
    "output_tokens": "transcript ids the engine returned (no re-tokenization)",
}


def add_asr_arguments(parser: argparse.ArgumentParser) -> None:
    asr = parser.add_argument_group("speech recognition")
    asr.add_argument("--asr", action="store_true",
                     help="ASR mode (Whisper, in-process or --url): synthetic clips of --audio-seconds (default "
                          f"{DEFAULT_ASR_SECONDS:g}), --output-len is max_output_tokens")


@dataclass
class ASRRecord:
    index: int
    audio_seconds: float
    send_time: float = 0.0
    first_token_time: float | None = None
    end_time: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


async def _transcribe(engine, index: int, clip: np.ndarray, max_tokens: int, seed: int) -> ASRRecord:
    from omniwalk.capabilities.transcription import TranscriptionRequest

    record = ASRRecord(index, len(clip) / SAMPLE_RATE, send_time=time.perf_counter())
    try:
        stream = engine.submit(TranscriptionRequest(clip, language="en", max_output_tokens=max_tokens, seed=seed),
                               loop=asyncio.get_running_loop())
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.token_ids and record.first_token_time is None:
                record.first_token_time = now
            record.output_tokens += len(chunk.token_ids)
            if chunk.finished:
                record.end_time, record.finish_reason, record.error = now, chunk.finish_reason, chunk.error
    except Exception as exc:   # counted as a failure, never hidden
        record.error = f"{type(exc).__name__}: {exc}"
    if record.end_time is None:
        record.end_time = time.perf_counter()
    return record


async def _transcribe_http(client, model: str | None, index: int, clip: np.ndarray, max_tokens: int,
                           seed: int) -> ASRRecord:
    """One clip through POST /v1/audio/transcriptions, streamed: SSE deltas, then the done
    event with the usage (its output_tokens: the ids the server produced)."""
    from omniwalk.bench.workload import wav_bytes

    record = ASRRecord(index, len(clip) / SAMPLE_RATE, send_time=time.perf_counter())
    form = {"stream": "true", "language": "en", "max_output_tokens": str(max_tokens), "seed": str(seed),
            **({"model": model} if model else {})}
    try:
        async with client.stream("POST", "/v1/audio/transcriptions", data=form,
                                 files={"file": ("clip.wav", wav_bytes(clip), "audio/wav")}) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            else:
                await _read_transcript_events(response, record)
    except Exception as exc:   # a transport failure fails this request only
        record.error = f"{type(exc).__name__}: {exc}"
    if record.end_time is None:
        record.end_time = time.perf_counter()
    if record.error is None and record.finish_reason is None:
        record.error = "the stream ended without a transcript.text.done event"
    return record


async def _read_transcript_events(response, record: ASRRecord) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event, now = json.loads(line[len("data: "):]), time.perf_counter()
        if event.get("type") == "transcript.text.delta" and record.first_token_time is None:
            record.first_token_time = now
        elif event.get("type") == "transcript.text.done":
            usage = event["usage"]
            record.end_time, record.output_tokens, record.finish_reason = now, usage["output_tokens"], \
                usage["finish_reason"]
        elif event.get("type") == "error":
            record.end_time, record.error = now, event["error"]["message"]


async def _closed_loop(send, clips, concurrency: int, seed: int) -> tuple[list[ASRRecord], float]:
    """`send(index, clip, seed)` for every clip, `concurrency` at a time."""
    slots = asyncio.Semaphore(concurrency)

    async def one(index, clip):
        async with slots:
            return await send(index, clip, seed + index)

    start = time.perf_counter()
    records = await asyncio.gather(*(one(i, clip) for i, clip in enumerate(clips)))
    return list(records), time.perf_counter() - start


async def _run_in_process(engine, clips, max_tokens: int, concurrency: int, seed: int):
    async def send(index, clip, clip_seed):
        return await _transcribe(engine, index, clip, max_tokens, clip_seed)
    return await _closed_loop(send, clips, concurrency, seed)


async def _run_http(url: str, model: str | None, timeout_s: float, clips, max_tokens: int, concurrency: int,
                    seed: int):
    from omniwalk.bench.backends import http_client, normalize_base_url

    async with http_client(normalize_base_url(url), timeout_s, None) as client:
        async def send(index, clip, clip_seed):
            return await _transcribe_http(client, model, index, clip, max_tokens, clip_seed)
        return await _closed_loop(send, clips, concurrency, seed)


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    array = np.asarray(values)
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def summarize(records: list[ASRRecord], duration: float) -> dict:
    ok = [r for r in records if r.error is None and r.finish_reason in ("length", "stop")]
    audio = sum(r.audio_seconds for r in ok)
    return {
        "num_requests": len(records), "num_completed": len(ok), "num_failed": len(records) - len(ok),
        "failures": [r.error or f"finish_reason {r.finish_reason}" for r in records if r not in ok][:20],
        "duration_s": duration, "audio_seconds": audio, "output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration, "audio_seconds_per_second": audio / duration,
        "run_rtf": duration / audio if audio else None,
        "latency_ms": _percentiles([(r.end_time - r.send_time) * 1e3 for r in ok]),
        "ttft_ms": _percentiles([(r.first_token_time - r.send_time) * 1e3 for r in ok if r.first_token_time]),
        "request_rtf": _percentiles([(r.end_time - r.send_time) / r.audio_seconds for r in ok]),
    }


def _format(label: str, s: dict) -> str:
    lines = [f"==== omniwalk bench --asr: {label} ".ljust(80, "="),
             f"  requests              {s['num_requests']} sent, {s['num_completed']} completed, {s['num_failed']} failed",
             f"  duration              {s['duration_s']:.3f} s for {s['audio_seconds']:.1f} s of audio",
             f"  request throughput    {s['request_throughput']:.2f} req/s",
             f"  audio s / s           {s['audio_seconds_per_second']:.1f}   (run RTF {s['run_rtf'] or 0:.4f})",
             f"  output tokens         {s['output_tokens']}"]
    for name, key in (("latency (ms)", "latency_ms"), ("TTFT (ms)", "ttft_ms"), ("request RTF", "request_rtf")):
        p = s[key]
        if p:
            lines.append(f"  {name:<20}  mean {p['mean']:.4g}  p50 {p['p50']:.4g}  p90 {p['p90']:.4g}  p99 {p['p99']:.4g}")
    return "\n".join(lines)


def run_asr_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """`omniwalk bench --asr`: 0, or 1 when any request failed."""
    concurrencies = parse_concurrency(args.concurrency) or [1]
    num = args.num_requests or 16
    max_tokens = int(str(args.output_len).split(":")[0])
    seconds = DEFAULT_ASR_SECONDS if args.audio_seconds is None else args.audio_seconds
    clips = [synthetic_clip(seconds, [args.seed, 0, i]) for i in range(num)]
    warmup = [synthetic_clip(seconds, [args.seed, 1, i]) for i in range(args.warmup)]
    runs = []
    with _asr_target(args) as (target, engine_args, run):
        print(f"target: {target}", flush=True)
        for concurrency in concurrencies:
            if warmup:
                asyncio.run(run(warmup, max_tokens, concurrency, args.seed + 7919))
            records, duration = asyncio.run(run(clips, max_tokens, concurrency, args.seed))
            summary = summarize(records, duration)
            print(_format(f"c={concurrency}, closed loop", summary), flush=True)
            runs.append({"concurrency": concurrency, "summary": summary})
    print("definitions:\n" + "\n".join(f"  {k:<26} {v}" for k, v in ASR_DEFINITIONS.items()))
    failed = sum(r["summary"]["num_failed"] for r in runs)
    if args.json:
        argv = list(sys.argv[1:] if argv is None else argv)
        write_json(args.json, {
            "command": "omniwalk " + shlex.join(argv), "argv": argv, "date": now_iso(), "mode": "asr",
            "machine": machine_info(),
            "config": {"target": target, "url": args.url, "engine_args": engine_args, "audio_seconds": seconds,
                       "max_output_tokens": max_tokens, "num_requests": num, "warmup": args.warmup, "seed": args.seed},
            "definitions": ASR_DEFINITIONS, "failed": failed > 0, "num_failed": failed, "runs": runs,
        })
    return exit_status(failed, sum(r["summary"]["num_requests"] for r in runs), "see the failures above")


@contextlib.contextmanager
def _asr_target(args: argparse.Namespace):
    """Yields (description, engine args or None, `run(clips, max_tokens, concurrency, seed)`
    coroutine function) for a server (`--url`) or an in-process engine."""
    if args.url:
        def run_http(clips, max_tokens, concurrency, seed):
            return _run_http(args.url, args.model, args.request_timeout, clips, max_tokens, concurrency, seed)
        yield f"{args.url} /v1/audio/transcriptions, model {args.model!r}", None, run_http
        return
    from omniwalk.api import Engine

    engine = Engine(_engine_args(args))
    try:
        def run_in_process(clips, max_tokens, concurrency, seed):
            return _run_in_process(engine, clips, max_tokens, concurrency, seed)
        yield (f"in-process {engine.loaded.name} ({engine.loaded.dtype}, {engine.loaded.device})",
               asdict(engine.args), run_in_process)
    finally:
        engine.shutdown()
