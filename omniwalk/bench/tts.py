"""`omniwalk bench --tts`: load a speech server (or an in-process speech engine) and report
time to first audio, real-time factor, audio throughput and streaming viability.

    omniwalk bench --tts --url http://127.0.0.1:8000 --concurrency 1,16,64 --output-len 700 \\
        --num-requests 128 --ignore-eos --json tts.json
    omniwalk bench --tts --model tiny-orpheus --concurrency 8 --output-len 28:210 --ignore-eos

Over HTTP each request is a POST /v1/audio/speech with stream_format=sse (base64 PCM
deltas, then speech.audio.done with the usage); without --url the model runs in-process
through `Engine.submit(SpeechRequest)`. `--output-len` is max_output_tokens: audio-code tokens, 7 per
frame (2048 samples = 85.3 ms of 24 kHz audio per frame for Orpheus). Texts come from
`--prompts-file` (one per line) or a built-in list; each request's seed is drawn from
`--seed`, so a run is reproducible. The figures are defined in `tts_metrics.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import numpy as np

from omniwalk.bench.backends import served_model_name
from omniwalk.bench.modes import ModeFigures, in_process_engine, resolve_concurrencies, run_mode
from omniwalk.bench.tts_backends import InProcessSpeechBackend, SpeechSSEBackend, TTSRequest
from omniwalk.bench.tts_metrics import TTS_DEFINITIONS, format_tts_summary, summarize_tts
from omniwalk.bench.workload import MEASURED, WARMUP, LengthRange, read_prompts

DEFAULT_TTS_MODEL = "tiny-orpheus"
DEFAULT_TTS_VOICE = "tara"
DEFAULT_TTS_REQUESTS = 32

TEXTS = (
    "The river ran past the old mill, and the miller's daughter counted the boats.",
    "Please hold while I transfer your call to the next available agent.",
    "It was the best of times, it was the worst of times.",
    "Turn left at the second light, then keep going until you see the bakery.",
    "Tomorrow will be cloudy in the morning, with sunshine and a light breeze by the afternoon.",
    "Could you read that number back to me, one digit at a time?",
    "The quick brown fox jumps over the lazy dog.",
    "Thanks for waiting. Your order has shipped and should arrive on Thursday.",
)


def add_tts_arguments(parser: argparse.ArgumentParser) -> None:
    tts = parser.add_argument_group("text to speech")
    tts.add_argument("--tts", action="store_true",
                     help="TTS mode: /v1/audio/speech with stream_format=sse (or in-process Engine.submit); "
                          "--output-len is then max_output_tokens in audio codes, --prompts-file the texts")
    tts.add_argument("--voice", default=None,
                     help=f"--tts, --speak: the voice of every request (default: {DEFAULT_TTS_VOICE} with --tts, "
                          "Ethan with --speak)")


def tts_requests(num: int, output_len: LengthRange, seed: int, stream: int = MEASURED,
                 texts: list[str] | None = None) -> list[TTSRequest]:
    """Texts in order (cycled to `num`; warmup from the end of the list), seeded budgets and seeds."""
    texts = list(texts or TEXTS)
    rng = np.random.default_rng([seed, stream])
    order = range(num) if stream == MEASURED else range(len(texts) - 1, len(texts) - 1 - num, -1)
    return [TTSRequest(index, texts[i % len(texts)], output_len.draw(rng), int(rng.integers(2**31)))
            for index, i in enumerate(order)]


def _texts(args: argparse.Namespace) -> list[str] | None:
    if not args.prompts_file:
        return None
    texts = read_prompts(args.prompts_file)
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("--tts needs text prompts, not token ids")
    return texts


@contextlib.contextmanager
def tts_backend_factory(args: argparse.Namespace):
    """Yields (description, engine or None, a function making a fresh backend inside an event loop)."""
    if args.url:
        make = functools.partial(SpeechSSEBackend, args.url, args.model, args.voice, args.ignore_eos,
                                 args.request_timeout)   # pickles: --client-processes
        yield f"{args.url} /v1/audio/speech (sse), model {args.model!r}", None, make
        return
    with in_process_engine(args, "speech") as (engine, description):
        yield description, engine, lambda: InProcessSpeechBackend(engine, args.voice, args.ignore_eos)


TTS_FIGURES = ModeFigures("tts", "--tts", summarize_tts, format_tts_summary, TTS_DEFINITIONS)


def run_tts_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """`omniwalk bench --tts`; the exit status as `run_bench`'s: 0, or 1 when any request failed."""
    if args.baseline is not None:
        raise ValueError("--baseline is for text generation, not --tts")
    if args.audio_seconds is not None:
        raise ValueError("--audio-seconds is for text workloads (audio in, text out) and --asr, not --tts")
    resolve_concurrencies(args)   # bad values fail before anything loads
    if args.url and args.model is None:
        args.model = served_model_name(args.url)
    args.model = args.model or DEFAULT_TTS_MODEL
    args.voice = args.voice or DEFAULT_TTS_VOICE
    num = args.num_requests or DEFAULT_TTS_REQUESTS
    if num < 1 or args.warmup < 0:
        raise ValueError("--num-requests must be >= 1 and --warmup >= 0")
    output_len, texts = LengthRange.parse(args.output_len), _texts(args)
    warmup = tts_requests(args.warmup, output_len, args.seed, WARMUP, texts)
    measured = tts_requests(num, output_len, args.seed, MEASURED, texts)
    config = {"voice": args.voice, "output_len": args.output_len, "prompts_file": args.prompts_file,
              "num_requests": num}
    return run_mode(args, argv, TTS_FIGURES, tts_backend_factory, warmup, measured, config)
