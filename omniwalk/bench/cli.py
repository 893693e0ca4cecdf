"""`omniwalk bench`: load a server (or an in-process engine) and report what it did.

    omniwalk bench --url http://127.0.0.1:8000 --concurrency 1,32 --input-len 128 --output-len 256 \\
        --num-requests 200 --warmup 16 --ignore-eos --json out.json
    omniwalk bench --model ~/ckpt/Qwen3-0.6B --load-format dummy --max-num-seqs 128 \\
        --concurrency 1,32,128 --ignore-eos --baseline hf --json out.json
    omniwalk bench --model benchmarks/qwen3-omni-30b-a3b --load-format dummy --audio-seconds 10 \\
        --concurrency 1,16 --input-len 64 --output-len 128 --ignore-eos
        (audio in, text out: one synthetic clip per request; over HTTP through /generate)
    omniwalk bench --tts --url http://127.0.0.1:8000 --concurrency 1,16 --output-len 700 --ignore-eos
        (text to speech: time to first audio, real-time factor, streaming viability; see tts.py)
    omniwalk bench --speak --model tiny-qwen3-omni --concurrency 1,8 --output-len 32 --audio-frames 64 --ignore-eos
        (chat answered in text and audio: TTFT, time to first audio, RTF, viability; see speak.py)
    omniwalk bench --asr --model tiny-whisper --concurrency 1,4 --audio-seconds 30 --output-len 64
        (speech recognition, in-process: requests/s, real-time factors; see asr.py)

`omniwalk/cli.py` registers the subcommand: `add_bench_arguments` adds these flags (the
engine flags come from there), `run_bench` runs it. Exit status: 0 when every request
completed as asked, 1 when any failed (a banner says so), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from omniwalk.bench.backends import (
    InProcessBackend, NativeGenerateBackend, OpenAICompletionsBackend, served_model_name,
)
from omniwalk.bench.client_processes import run_phases
from omniwalk.bench.metrics import DEFINITIONS, summarize
from omniwalk.bench.report import (
    exit_status, format_definitions, format_summary, machine_info, now_iso, run_summary_where, write_json,
)
from omniwalk.bench.runner import PhaseResult, Progress, run_phase
from omniwalk.bench.server_metrics import ServerTTFT
from omniwalk.bench.workload import (
    MEASURED, WARMUP, LengthRange, arrival_gaps, check_audio_seconds, file_requests, normal_vocabulary,
    read_prompts, synthetic_requests, with_audio,
)

DEFAULT_MODEL = "tiny-qwen3"
DEFAULT_SYNTHETIC_REQUESTS = 100


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--url", "--base-url", default=None,
                        help="a running OpenAI-compatible server (any; a key from $OPENAI_API_KEY or "
                             "$OMNIWALK_API_KEY is sent as a bearer token) (default: none: the model runs in-process)")
    target.add_argument("--model", default=None,
                        help="with --url: the served model name (default: the first of /v1/models); "
                             f"without: a built-in name or a local HF folder, run in-process (default {DEFAULT_MODEL}; "
                             "tiny-orpheus with --tts)")
    target.add_argument("--tokenizer", default=None,
                        help="built-in name or HF folder whose vocabulary prompts are drawn from (default: --model)")
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds per HTTP request")
    target.add_argument("--client-processes", type=_positive_int, default=1, metavar="N",
                        help="with --url: spread the load generator (warmup and measured phase) over N processes, "
                             "request i to process i %% N, the concurrency split between them (so N is capped at "
                             "the concurrency); for when one process is busy (`load_generator` in the output). "
                             "Text, --tts and --speak; not --asr (default 1)")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--input-len", "--random-input-len", default="128",
                          help="prompt tokens: N or LOW:HIGH (uniform)")
    workload.add_argument("--output-len", "--random-output-len", default="128",
                          help="max_tokens: N or LOW:HIGH (uniform); with --tts, audio-code tokens")
    workload.add_argument("--prompts-file", default=None,
                          help="prompts instead of random tokens: one per line, or JSONL with `prompt` "
                               "(default: none: random tokens)")
    workload.add_argument("--num-requests", "--num-prompts", type=int, default=None,
                          help=f"measured requests per run (default {DEFAULT_SYNTHETIC_REQUESTS}, "
                               f"or the file's prompts)")
    workload.add_argument("--warmup", type=int, default=0, help="requests sent first at each run, not measured")
    workload.add_argument("--audio-seconds", type=float, default=None, metavar="S",
                          help="audio in: each request also carries one seeded synthetic clip of S seconds "
                               "(16 kHz, 0 < S <= 600); over HTTP sent to /generate as a WAV data URL. "
                               "With --asr: the clip of each request (default: none: text only)")
    workload.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths, clips and arrivals")
    workload.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens ids per request")
    workload.add_argument("--concurrency", "--max-concurrency", default=None,
                          help="requests in flight: one value or a list (1,32,128: one run each). Closed loop; "
                               "with --request-rate, a cap (default: 1; with --request-rate, no cap)")
    workload.add_argument("--request-rate", type=float, default=None,
                          help="Poisson arrivals at this many requests/s (seeded) instead of a closed loop "
                               "(default: none: closed loop)")

    output = parser.add_argument_group("output")
    output.add_argument("--json", default=None, metavar="PATH",
                        help="write every figure, the command and the machine (default: none)")
    output.add_argument("--save-result", action="store_true",
                        help="vLLM's spelling of --json: write the JSON to --result-dir/--result-filename")
    output.add_argument("--result-dir", default=".", help="--save-result: the folder")
    output.add_argument("--result-filename", default=None,
                        help="--save-result: the file name (default: omniwalk-bench-MODEL-DATE.json)")
    output.add_argument("--no-progress", action="store_true", help="no progress line on stderr")

    baseline = parser.add_argument_group("baseline")
    baseline.add_argument("--baseline", choices=["hf"], default=None,
                          help="hf: the same prompts through transformers generate, batch = concurrency "
                               "(default: none)")
    baseline.add_argument("--hf-model", default=None, help="HF folder for the baseline (default: --model)")
    baseline.add_argument("--hf-modes", default="eager,static_compiled", help="eager and/or static_compiled")
    baseline.add_argument("--hf-compile-backend", default="inductor", help="torch.compile backend of static_compiled")
    baseline.add_argument("--hf-compile-mode", default=None,
                          help="torch.compile mode (default: reduce-overhead on CUDA, default on CPU)")
    baseline.add_argument("--hf-warmup-batches", type=int, default=1, help="untimed batches before each mode")
    baseline.add_argument("--hf-max-batches", type=int, default=3,
                          help="timed batches per batch size, at most (0: every request, in ceil(n / c) batches)")

    from omniwalk.bench.asr import add_asr_arguments   # asr.py, tts.py and speak.py build on this module
    from omniwalk.bench.speak import add_speak_arguments
    from omniwalk.bench.tts import add_tts_arguments

    add_tts_arguments(parser)
    add_speak_arguments(parser)
    add_asr_arguments(parser)


# ----------------------------------------------------------------------------- settings


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def check_bench_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What one flag cannot check alone; `parser.error` (exit status 2) when wrong."""
    if args.client_processes > 1 and not args.url:
        parser.error("--client-processes needs --url: an in-process engine shares the bench's process")
    if args.client_processes > 1 and args.asr:
        parser.error("--client-processes: --asr runs its load generator in one process (text, --tts and "
                     "--speak take it)")


def parse_concurrency(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--concurrency takes integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency values must be >= 1, got {text!r}")
    return values


def resolve_tokenizer(name: str):
    from omniwalk.models.registry import BUILTIN_MODELS, TINY_TOKENIZER
    from omniwalk.tokenizer import load_tokenizer

    if name in BUILTIN_MODELS:
        return load_tokenizer(TINY_TOKENIZER)
    if Path(name).is_dir():
        return load_tokenizer(Path(name))
    raise ValueError(f"no tokenizer for {name!r}: give --tokenizer with a built-in name or a local HF folder")


def build_workload(args: argparse.Namespace, tokenizer) -> tuple[list, list]:
    """(warmup requests, measured requests): the same at every concurrency of this invocation."""
    output_len = LengthRange.parse(args.output_len)
    if args.prompts_file:
        prompts = read_prompts(args.prompts_file)
        num = args.num_requests or len(prompts)

        def make(n: int, stream: int):
            return file_requests(prompts, tokenizer, n, output_len, args.seed, stream)
    else:
        input_len, vocabulary = LengthRange.parse(args.input_len), normal_vocabulary(tokenizer)
        num = args.num_requests or DEFAULT_SYNTHETIC_REQUESTS

        def make(n: int, stream: int):
            return synthetic_requests(n, input_len, output_len, vocabulary, args.seed, stream)
    if num < 1 or args.warmup < 0:
        raise ValueError("--num-requests must be >= 1 and --warmup >= 0")
    warmup, measured = make(args.warmup, WARMUP), make(num, MEASURED)
    if args.audio_seconds is None:
        return warmup, measured
    check_audio_seconds(args.audio_seconds)
    # over HTTP each clip travels as a WAV data URL: encoded here, once, before any run is timed
    data_urls = bool(args.url)
    return (with_audio(warmup, args.audio_seconds, args.seed, WARMUP, data_urls),
            with_audio(measured, args.audio_seconds, args.seed, MEASURED, data_urls))


def _engine_args(args: argparse.Namespace):
    from omniwalk.loading import EngineArgs

    return EngineArgs.from_flags(args, skip=("seed",))   # --seed is the workload's


def _arrival_label(concurrency: int | None, rate: float | None) -> str:
    if rate is None:
        return f"c={concurrency}, closed loop"
    cap = f"at most {concurrency} in flight" if concurrency else "no cap on requests in flight"
    return f"Poisson {rate:g} req/s, {cap}"


# ----------------------------------------------------------------------------- running


@contextlib.contextmanager
def backend_factory(args: argparse.Namespace):
    """Yields (description, engine or None, a function making a fresh backend inside an event loop)."""
    if args.url and args.audio_seconds is not None:   # /v1/completions takes no audio
        # a partial of a class, not a closure: --client-processes sends it to other processes
        make = functools.partial(NativeGenerateBackend, args.url, args.ignore_eos, args.request_timeout)
        yield f"{args.url} /generate with audio, model {args.model!r}", None, make
        return
    if args.url:
        make = functools.partial(OpenAICompletionsBackend, args.url, args.model, args.ignore_eos,
                                 args.request_timeout)
        yield f"{args.url} /v1/completions, model {args.model!r}", None, make
        return
    from omniwalk.bench.modes import in_process_engine   # modes.py builds on this module

    with in_process_engine(args) as (engine, description):
        yield description, engine, lambda: InProcessBackend(engine, args.ignore_eos)


async def _phases(make_backend, warmup, measured, gaps, concurrency, label, show_progress, before_measured=None):
    # The client's garbage collector as the engine's (`quiet_gc`): what exists now (torch,
    # the tokenizer, the workload) frozen, the young generation collected less often. The
    # in-process runs had it from their Engine; the HTTP client had not, and a full
    # collection over ~280,000 objects paused it for 0.2-0.6 s at the start of a run, with
    # 3-10 ms young collections throughout (tiny-qwen3-omni --speak, c = 32, 2-core host).
    from omniwalk.engine_loop import quiet_gc

    thresholds = quiet_gc()
    backend = make_backend()
    try:
        warm = None
        if warmup:
            warm = await run_phase(backend, warmup, [0.0] * len(warmup), concurrency or len(warmup),
                                   Progress(f"{label} warmup", len(warmup), show_progress))
        if before_measured is not None:   # a load generator process: wait for the others' warmups
            before_measured()
        result = await run_phase(backend, measured, gaps, concurrency,
                                 Progress(label, len(measured), show_progress))
    finally:
        await backend.aclose()
        gc.unfreeze()   # an in-process Engine's shutdown unfreezes what it froze anyway
        gc.set_threshold(*thresholds)
    return warm, result


def _where(engine) -> str:
    return "in its own process" if engine.in_engine_process else "on a thread"


def _gpu_peak(engine, reset: bool) -> int | None:
    if engine is None or engine.loaded.device.type != "cuda":
        return None
    return engine.inspect(cuda_peak_memory, str(engine.loaded.device), reset)   # where the model is


def cuda_peak_memory(runtime, device: str, reset: bool) -> int | None:
    """On the engine loop (`Engine.inspect`, the engine process if there is one): the peak
    bytes allocated on `device`, or None after resetting it."""
    import torch

    if reset:
        torch.cuda.reset_peak_memory_stats(device)
        return None
    return int(torch.cuda.max_memory_allocated(device))


def _one_run(args, engine, make_backend, warmup, measured, concurrency, hf) -> dict:
    label = _arrival_label(concurrency, args.request_rate)
    gaps = arrival_gaps(len(measured), args.request_rate, args.seed)
    _gpu_peak(engine, reset=True)
    server_ttft = ServerTTFT(args.url) if args.url else None
    warm, result, load = run_phases(make_backend, warmup, measured, gaps, concurrency, label,
                                    not args.no_progress, args.client_processes)
    load = None if engine is not None else load   # in-process the engine shares the process: no meaning
    server = server_ttft.mean_ms() if server_ttft is not None else None
    summary = summarize(result.records, result.start, result.end, args.ignore_eos)
    gpu_peak = _gpu_peak(engine, reset=False)
    table = format_summary(f"omniwalk bench: {label}", summary, hf, gpu_peak)
    lines = [table] + (load.lines() if load else [])
    if server is not None:
        lines.append(f"  server-side TTFT      mean {server['mean_ms']:.2f} ms over {server['count']} requests "
                     "(its /metrics; warm-up included)")
    print("\n".join(lines), flush=True)
    warm_summary = _warmup_summary(warm, args.ignore_eos)
    if warm_summary and warm_summary["num_failed"]:
        print(f"  WARMUP: {warm_summary['num_failed']} of {warm_summary['num_requests']} requests failed",
              flush=True)
    return {"concurrency": concurrency, "request_rate": args.request_rate, "arrivals": label,
            "summary": summary.to_dict(), "warmup": warm_summary, "gpu_peak_allocated_bytes": gpu_peak,
            "load_generator": None if load is None else load.to_dict(), "server_ttft": server, "hf_baseline": hf}


def _warmup_summary(warm: PhaseResult | None, ignore_eos: bool) -> dict | None:
    if warm is None:
        return None
    summary = summarize(warm.records, warm.start, warm.end, ignore_eos)
    return {"num_requests": summary.num_requests, "num_failed": summary.num_failed, "failures": summary.failures}


def _hf_baselines(args, measured, batch_sizes) -> dict[int, dict]:
    from omniwalk.bench.hf_baseline import HFBaselineConfig, run_hf_baseline

    config = HFBaselineConfig(
        model=args.hf_model or args.model, load_format=getattr(args, "load_format", "auto"),
        dtype=getattr(args, "dtype", "auto"), device=getattr(args, "device", "auto"),
        compile_backend=args.hf_compile_backend, compile_mode=args.hf_compile_mode,
        warmup_batches=args.hf_warmup_batches, max_batches=args.hf_max_batches or None,
        modes=tuple(m for m in args.hf_modes.split(",") if m),
    )
    return run_hf_baseline(config, measured, batch_sizes)


def resolve_result_path(args: argparse.Namespace) -> None:
    """`--save-result` (vLLM's flag) as `--json`: the path from --result-dir and --result-filename."""
    if not getattr(args, "save_result", False) or args.json:
        return
    mode = next((m for m in ("tts", "speak", "asr") if getattr(args, m, False)), "text")
    name = args.result_filename or \
        f"omniwalk-bench-{mode}-{Path(args.model or 'served').name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    args.json = str(Path(args.result_dir) / name)


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    resolve_result_path(args)
    if getattr(args, "speak", False):
        from omniwalk.bench.speak import run_speak_bench

        return run_speak_bench(args, argv)
    if getattr(args, "audio_frames", None) is not None:
        raise ValueError("--audio-frames is the frame budget of --speak")
    if getattr(args, "tts", False):
        from omniwalk.bench.tts import run_tts_bench

        return run_tts_bench(args, argv)
    if getattr(args, "asr", False):
        from omniwalk.bench.asr import run_asr_bench

        return run_asr_bench(args, argv)
    concurrencies = parse_concurrency(args.concurrency)
    if concurrencies is None:
        concurrencies = [None] if args.request_rate is not None else [1]
    if args.baseline == "hf" and None in concurrencies:
        raise ValueError("--baseline hf needs --concurrency: it is the baseline's batch size")
    if args.baseline == "hf" and args.audio_seconds is not None:
        raise ValueError("--baseline hf is a text-only baseline: it cannot take --audio-seconds "
                         "(run the audio workload without --baseline)")
    if args.url and args.model is None:
        args.model = served_model_name(args.url)
    args.model = args.model or DEFAULT_MODEL
    tokenizer = resolve_tokenizer(args.tokenizer or args.model)
    warmup, measured = build_workload(args, tokenizer)

    # the baseline runs first and frees its model: an in-process engine sizes its KV cache from free memory
    hf = _hf_baselines(args, measured, concurrencies) if args.baseline == "hf" else {}
    runs = []
    with backend_factory(args) as (target, engine, make_backend):
        print(f"target: {target}", flush=True)
        if engine is not None and max(c or 0 for c in concurrencies) > engine.args.max_num_seqs:
            print(f"note: concurrency above --max-num-seqs {engine.args.max_num_seqs}: the excess queues",
                  file=sys.stderr)
        for concurrency in concurrencies:
            runs.append(_one_run(args, engine, make_backend, warmup, measured, concurrency, hf.get(concurrency)))
        engine_args = asdict(engine.args) if engine is not None else None

    print(format_definitions())
    failed = sum(r["summary"]["num_failed"] + ((r["warmup"] or {}).get("num_failed") or 0) for r in runs)
    sent = sum(r["summary"]["num_requests"] + ((r["warmup"] or {}).get("num_requests") or 0) for r in runs)
    if args.json:
        argv = list(sys.argv[1:] if argv is None else argv)
        write_json(args.json, {
            "command": "omniwalk " + shlex.join(argv), "argv": argv, "date": now_iso(),
            "machine": machine_info(), "config": _config(args, target, engine_args, concurrencies),
            "definitions": DEFINITIONS, "failed": failed > 0, "num_failed": failed, "runs": runs,
        })
    return exit_status(failed, sent, run_summary_where(runs))


def _config(args, target: str, engine_args: dict | None, concurrencies) -> dict:
    return {
        "target": target, "url": args.url, "model": args.model, "tokenizer": args.tokenizer or args.model,
        "engine_args": engine_args, "input_len": None if args.prompts_file else args.input_len,
        "output_len": args.output_len, "prompts_file": args.prompts_file, "num_requests": args.num_requests,
        "audio_seconds": args.audio_seconds, "warmup": args.warmup, "seed": args.seed,
        "ignore_eos": args.ignore_eos, "concurrency": concurrencies,
        "request_rate": args.request_rate, "client_processes": args.client_processes, "baseline": args.baseline,
        "hf": None if args.baseline != "hf" else {
            "model": args.hf_model or args.model, "modes": args.hf_modes,
            "compile_backend": args.hf_compile_backend, "compile_mode": args.hf_compile_mode,
            "warmup_batches": args.hf_warmup_batches, "max_batches": args.hf_max_batches,
        },
    }
