"""`omniwalk bench --speak`: chat answered in text and audio (Qwen3-Omni with its Talker):
time to first token, time to first audio, real-time factor, audio throughput and
streaming viability, in-process or over HTTP.

    omniwalk bench --speak --model benchmarks/qwen3-omni-30b-a3b-full --load-format dummy \\
        --concurrency 1,8,32 --input-len 32 --output-len 180 --audio-frames 660 --ignore-eos
    omniwalk bench --speak --url http://127.0.0.1:8000 --concurrency 8 --output-len 180 --audio-frames 660 \\
        --ignore-eos

Each request is one user message (`--input-len` random ids of the tokenizer's vocabulary,
decoded to text, or a line of `--prompts-file`) in the chat template, answered in
`--voice` (default Ethan) with `--output-len` text tokens at most (max_tokens) and
`--audio-frames` codec frames at most (audio.max_frames; 12.5 frames a second of audio).
`--ignore-eos` asks for exactly both: the Thinker ignores its EOS and the Talker its
codec EOS (random weights would otherwise end each at a random point). Over HTTP each
request is a streamed POST /v1/chat/completions with `modalities: ["text", "audio"]` and
audio format pcm16; in-process the same turn (its ids as the template renders them) goes
to `Engine.submit(GenerationRequest(speech=SpeechOutput(...)))`. The figures are defined
in `speak_metrics.py`; the run loop, the JSON and the exit status are `modes.py`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import numpy as np

from omniwalk.bench.backends import served_model_name
from omniwalk.bench.modes import ModeFigures, in_process_engine, resolve_concurrencies, run_mode
from omniwalk.bench.speak_backends import ChatAudioSSEBackend, InProcessSpokenChatBackend, SpokenChatRequest
from omniwalk.bench.speak_metrics import SPEAK_DEFINITIONS, format_speak_summary, summarize_speak
from omniwalk.bench.workload import MEASURED, SPEECH, WARMUP, BenchRequest, LengthRange

DEFAULT_SPEAK_MODEL = "tiny-qwen3-omni"
DEFAULT_SPEAK_VOICE = "Ethan"
DEFAULT_SPEAK_REQUESTS = 32
DEFAULT_AUDIO_FRAMES = "128"


def add_speak_arguments(parser: argparse.ArgumentParser) -> None:
    speak = parser.add_argument_group("chat with audio out")
    speak.add_argument("--speak", action="store_true",
                       help="chat answered in text and audio (Qwen3-Omni): /v1/chat/completions with modalities "
                            "text + audio, streamed in pcm16 (or in-process Engine.submit); --output-len is "
                            "max_tokens of the text, --audio-frames the frames of the audio, --voice the voice")
    speak.add_argument("--audio-frames", default=None, metavar="N|LOW:HIGH",
                       help=f"--speak: audio.max_frames of each request, codec frames (12.5 a second): N or "
                            f"LOW:HIGH (uniform) (default {DEFAULT_AUDIO_FRAMES})")


def speak_requests(requests: list[BenchRequest], tokenizer, frames: LengthRange, seed: int,
                   stream: int = MEASURED) -> list[SpokenChatRequest]:
    """The text workload's requests as chat turns: each prompt decoded to the user's message
    and rendered by the tokenizer's chat template (as the chat route renders it), with a
    seeded frame budget and sampling seed each (their own generator: the prompts and text
    budgets are the text mode's draws)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--speak renders each prompt as a chat: its tokenizer has no chat template "
                         "(give --tokenizer, or a model folder with tokenizer files)")
    rng = np.random.default_rng([seed, SPEECH, stream])
    out = []
    for request in requests:
        content = tokenizer.decode(request.prompt_token_ids)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(chat, add_special_tokens=False)
        out.append(SpokenChatRequest(request.index, content, ids, request.output_len, frames.draw(rng),
                                     int(rng.integers(2**31))))
    return out


@contextlib.contextmanager
def speak_backend_factory(args: argparse.Namespace):
    """Yields (description, engine or None, a function making a fresh backend inside an event loop)."""
    if args.url:
        make = functools.partial(ChatAudioSSEBackend, args.url, args.model, args.voice, args.ignore_eos,
                                 args.request_timeout)   # pickles: --client-processes
        yield f"{args.url} /v1/chat/completions (text + audio, sse), model {args.model!r}", None, make
        return
    from omniwalk.capabilities import Capability

    with in_process_engine(args, "chat with audio out") as (engine, description):
        voices = engine.frontend(Capability.TEXT).voices if Capability.TEXT in engine.capabilities else ()
        if not voices:
            raise ValueError(f"--speak: {args.model} does not speak (no Talker: a Qwen3-Omni checkpoint with "
                             f"talker_config, code2wav_config and enable_audio_output, e.g. {DEFAULT_SPEAK_MODEL})")
        if args.voice.lower() not in voices:
            raise ValueError(f"--voice {args.voice!r}: {args.model} speaks in {', '.join(voices)}")
        yield description, engine, lambda: InProcessSpokenChatBackend(engine, args.voice, args.ignore_eos)


SPEAK_FIGURES = ModeFigures("speak", "--speak", summarize_speak, format_speak_summary, SPEAK_DEFINITIONS)


def run_speak_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """`omniwalk bench --speak`; the exit status as `run_bench`'s: 0, or 1 when any request failed."""
    from omniwalk.bench.cli import build_workload, resolve_tokenizer

    if args.tts or args.asr:
        raise ValueError("--speak is a mode of its own: not with --tts or --asr")
    if args.baseline is not None:
        raise ValueError("--baseline is for text generation, not --speak")
    if args.audio_seconds is not None:
        raise ValueError("--audio-seconds (audio in) is not part of --speak's workload yet (the server speaks "
                         "about audio in the prompt; the bench sends text prompts only)")
    frames = LengthRange.parse(args.audio_frames or DEFAULT_AUDIO_FRAMES)
    resolve_concurrencies(args)   # bad values fail before anything loads
    if args.url and args.model is None:
        args.model = served_model_name(args.url)
    args.model = args.model or DEFAULT_SPEAK_MODEL
    args.voice = args.voice or DEFAULT_SPEAK_VOICE
    if args.num_requests is None and not args.prompts_file:
        args.num_requests = DEFAULT_SPEAK_REQUESTS
    tokenizer = resolve_tokenizer(args.tokenizer or args.model)
    text_warmup, text_measured = build_workload(args, tokenizer)
    warmup = speak_requests(text_warmup, tokenizer, frames, args.seed, WARMUP)
    measured = speak_requests(text_measured, tokenizer, frames, args.seed, MEASURED)
    config = {"tokenizer": args.tokenizer or args.model, "voice": args.voice,
              "input_len": None if args.prompts_file else args.input_len, "output_len": args.output_len,
              "audio_frames": str(frames), "prompts_file": args.prompts_file, "num_requests": len(measured)}
    return run_mode(args, argv, SPEAK_FIGURES, speak_backend_factory, warmup, measured, config)
