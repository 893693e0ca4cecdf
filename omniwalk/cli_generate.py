"""`omniwalk generate`: one request in-process, by what the model serves.

    omniwalk generate tiny-qwen3 "Hello" --max-tokens 16        text: printed (--stream: as it comes)
    omniwalk generate tiny-orpheus "Hello" -o hello.wav          speech: written to -o (.wav, .flac, .pcm)
    omniwalk generate tiny-whisper --audio talk.wav              transcription: the text printed
                                                                 (PROMPT, if given: text to condition on)

The last line on stdout is the usage, `[finish_reason=... ...]`; exit status 1 when the
request failed, 2 for bad flags or a bad request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omniwalk.capabilities import Capability

#: -o suffix -> response format of server/speech.py's encode_audio
AUDIO_SUFFIXES = {".wav": "wav", ".flac": "flac", ".pcm": "pcm"}


def add_generate_arguments(generate: argparse.ArgumentParser) -> None:
    generate.add_argument("model", help="a built-in name or a local Hugging Face checkpoint folder")
    generate.add_argument("prompt", nargs="?", default=None,
                          help="the prompt (text models), the text to speak (speech models) or text to "
                               "condition the transcript on (transcription models) (default: none)")
    generate.add_argument("--max-tokens", type=int, default=None,
                          help="output tokens: text 16 unless given; speech: audio-code tokens (7 per frame), "
                               "the model's default (1200) unless given; transcription: up to the end "
                               "(default: by model)")
    generate.add_argument("--temperature", type=float, default=None,
                          help="0: greedy (default: 0 for text and transcription, the model's for speech)")
    generate.add_argument("--seed", dest="request_seed", type=int, default=None,
                          help="sampling seed (random weights always use the engine's default seed) (default: drawn)")
    generate.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")
    generate.add_argument("--stream", action="store_true", help="text: print it as it is generated")
    generate.add_argument("-o", "--output", default=None, metavar="FILE",
                          help="speech: the audio file to write, .wav, .flac or .pcm (default: none; speech needs it)")
    generate.add_argument("--voice", default=None, help="speech: one of the model's voices (default: the model's)")
    generate.add_argument("--audio", default=None, metavar="FILE",
                          help="transcription: the audio file to transcribe (WAV, FLAC, MP3, OGG) (default: none)")
    generate.add_argument("--language", default=None,
                          help="transcription: the language (en, english; default: detected)")


def run_generate(engine, args: argparse.Namespace) -> int:
    """The request `args` describe, on `engine`, by the capability the flags and the model call for."""
    capabilities = engine.capabilities
    if args.audio is not None:
        if Capability.TRANSCRIPTION not in capabilities:
            raise ValueError(f"{args.model} does not transcribe audio: --audio is for a speech recognition model")
        return _transcribe(engine, args)
    if args.prompt is None:
        hint = " (give --audio FILE)" if Capability.TRANSCRIPTION in capabilities else ""
        raise ValueError(f"give a prompt{hint}")
    if Capability.TEXT in capabilities:
        return _text(engine, args)
    if Capability.SPEECH in capabilities:
        return _speak(engine, args)
    raise ValueError(f"{args.model} transcribes audio: give --audio FILE")


def _text(engine, args: argparse.Namespace) -> int:
    from omniwalk.capabilities.text import GenerationRequest
    from omniwalk.engine.sampler import SamplingParams

    request = GenerationRequest(
        prompt=args.prompt, max_tokens=16 if args.max_tokens is None else args.max_tokens,
        ignore_eos=args.ignore_eos, sampling=SamplingParams(temperature=args.temperature or 0.0,
                                                            seed=args.request_seed),
    )
    stream = engine.submit(request)
    if args.stream:
        for last in stream:
            print(last.text, end="", flush=True)
        print()
    else:
        last = stream.result()
        print(last.text)
    usage = last.usage
    print(f"[finish_reason={last.finish_reason} prompt_tokens={usage.prompt_tokens} "
          f"output_tokens={usage.output_tokens}]")
    return _status(last.error)


def _speak(engine, args: argparse.Namespace) -> int:
    from omniwalk.capabilities.speech import SpeechRequest, synthesize
    from omniwalk.server.speech import encode_audio

    if args.output is None:
        raise ValueError(f"{args.model} speaks: give -o FILE ({', '.join(AUDIO_SUFFIXES)}) for the audio")
    output = Path(args.output)
    audio_format = AUDIO_SUFFIXES.get(output.suffix.lower())
    if audio_format is None:
        raise ValueError(f"-o {output}: the file name must end in {', '.join(AUDIO_SUFFIXES)}")
    options = {"max_output_tokens": args.max_tokens, "temperature": args.temperature, "voice": args.voice}
    request = SpeechRequest(args.prompt, ignore_eos=args.ignore_eos, seed=args.request_seed,
                            **{name: value for name, value in options.items() if value is not None})
    result = synthesize(engine, request)
    output.write_bytes(encode_audio(result.pcm, audio_format, result.sampling_rate))
    usage = result.usage
    print(f"wrote {output}: {usage.samples / result.sampling_rate:.2f} s of {result.sampling_rate} Hz audio")
    print(f"[finish_reason={result.finish_reason} prompt_tokens={usage.prompt_tokens} "
          f"output_tokens={usage.output_tokens} codes={usage.codes} frames={usage.frames} samples={usage.samples}]")
    return _status(result.error)


def _transcribe(engine, args: argparse.Namespace) -> int:
    from omniwalk.capabilities.transcription import TranscriptionRequest, transcribe

    path = Path(args.audio)
    if not path.is_file():
        raise ValueError(f"--audio {path}: no such file")
    options = {"max_output_tokens": args.max_tokens, "temperature": args.temperature, "language": args.language,
               "prompt": args.prompt}
    request = TranscriptionRequest(path.read_bytes(), seed=args.request_seed,
                                   **{name: value for name, value in options.items() if value is not None})
    result = transcribe(engine, request)
    print(result.text)
    usage = result.usage
    print(f"[finish_reason={result.finish_reason} audio_seconds={usage.audio_seconds:.2f} "
          f"output_tokens={usage.output_tokens}]")
    return _status(result.error)


def _status(error: str | None) -> int:
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
