"""The `omniwalk` command.

    omniwalk serve [MODEL] [--host H --port P ...]      the HTTP server (default model: tiny-qwen3)
    omniwalk generate MODEL "prompt" --max-tokens N      one generation in-process, printed
    omniwalk bench [--url URL] [--model M] ...           load generator and metrics (omniwalk/bench/cli.py)
    omniwalk --version
"""

from __future__ import annotations

import argparse
import logging
import sys

from omniwalk.cli_generate import __doc__ as generate_doc
from omniwalk.cli_generate import add_generate_arguments, run_generate
from omniwalk.loading import EngineArgs
from omniwalk.logs import configure_logging
from omniwalk.server import limits
from omniwalk.server.auth import API_KEY_ENV, api_key_from_env
from omniwalk.server.generation import DEFAULT_FRONTEND_THREADS
from omniwalk.server.media import DEFAULT_MAX_MEDIA_BYTES
from omniwalk.server.metrics import METRICS_COMPAT
from omniwalk.version import package_version

_DEFAULTS = EngineArgs()

#: --dtype as vLLM spells it -> the name EngineArgs takes
DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
          "float": "float32", "float32": "float32"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says what it is
    (a default of None usually means something to spell out: "the model's", "none"). Descriptions
    keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default is argparse.SUPPRESS or not action.option_strings:
            return help_text
        return help_text + " (default: %(default)s)"


def _dtype(text: str) -> str:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(DTYPES)})") from None


def _add_engine_flags(parser: argparse.ArgumentParser, seed: bool = True, engine_process: bool = False) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=engine_process,
                       help="run the engine loop (model, device) in a process of its own, apart from the API "
                            "side's HTTP, tokenization and detokenization (default: %(default)s)")
    group.add_argument("--dtype", type=_dtype, default=_DEFAULTS.dtype, metavar="{" + ",".join(DTYPES) + "}",
                       help="weights and activations, as vLLM spells them: half = float16, float = float32; "
                            "auto: float32 on CPU, bfloat16 on CUDA (default: auto)")
    group.add_argument("--device", default=_DEFAULTS.device, help="auto, cpu, cuda, cuda:1, ...")
    group.add_argument("--load-format", default=_DEFAULTS.load_format, choices=["auto", "dummy"],
                       help="dummy: random weights at the checkpoint's shape (no weight files read)")
    if seed:
        group.add_argument("--seed", type=int, default=_DEFAULTS.seed,
                           help="seed of random weights and of requests that bring none")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs, help="requests running at once")
    group.add_argument("--max-queue", type=int, default=_DEFAULTS.max_queue,
                       help="requests waiting beyond --max-num-seqs before answering 429")
    group.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens,
                       help="tokens one engine step computes at most (prefill chunks and decode steps together)")
    group.add_argument("--kv-cache-tokens", type=int, default=None,
                       help="KV cache size in tokens (default: 65536 on CPU, from free memory on GPU)")
    group.add_argument("--page-size", type=int, default=_DEFAULTS.page_size, help="tokens per KV cache page")
    group.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS.gpu_memory_utilization,
                       help="CUDA: the fraction of the GPU's memory the engine may use (weights, KV cache, graphs)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                       help="split the model over this many devices, one process each (vLLM's flag; Qwen3, "
                            "Llama, Qwen3.5; needs --engine-process, the engine process is rank 0; on CPU: gloo); "
                            "the shorthand of a placement whose one group has this size (default: 1, or the "
                            "--placement file's first group's)")
    group.add_argument("--placement", default=None, metavar="FILE",
                       help="a YAML file: which of the model's nodes run in which worker group, on which devices, "
                            "with which tensor-parallel size (docs/placement.md) (default: every node in the "
                            "engine process, on --device)")
    group.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="run the --placement file's worker groups as actors of the Ray cluster at ADDRESS "
                            "(host:port of its head, or auto), placed and watched by Ray; needs Ray: pip install "
                            "'omniwalk[ray]' (docs/placement.md, \"Ray\") (default: worker processes of this host)")
    group.add_argument("--enforce-eager", action="store_true", help="CUDA: decode without CUDA graphs")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS.enable_prefix_caching,
                       help="share the KV cache pages of common prompt prefixes (vLLM's flag; not on hybrid models)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="compute every prompt in full: the same as --no-enable-prefix-caching "
                            "(default: prefix caching on)")
    group.add_argument("--quantization", default=None, choices=["fp8"],
                       help="fp8: the decoder's linear layers in FP8 (per-channel weights, per-token activations; "
                            "Llama / Qwen3 / Orpheus, GPUs of compute capability 8.9+) (default: none)")
    group.add_argument("--burst-window-ms", type=float, default=_DEFAULTS.burst_window_ms,
                       help="an idle engine woken by a request first waits while more arrive, each within this "
                            "many ms of the last (at most 50 ms in all), so a burst is prefilled together; 0: off")
    group.add_argument("--no-startup-warmup", dest="startup_warmup", action="store_const", const=False, default=None,
                       help="CUDA: start without the warm-up: the MoE kernels run at every batch size class and "
                            "a few warm-up requests, which compile at load what the first requests would otherwise "
                            "compile in their steps (seconds; Triton keeps them on disk) (default: warm up on CUDA)")
    group.add_argument("--codec", default=None,
                       help="TTS checkpoints: local codec folder (Orpheus: SNAC; default: MODEL/snac)")


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one client may ask of `omniwalk serve` (omniwalk/server/limits.py)."""
    sizes = parser.add_argument_group("request limits")
    sizes.add_argument("--max-request-body-bytes", type=int, metavar="BYTES",
                       default=limits.DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="the largest JSON body; larger ones get a 413 before they are read (default: %(default)s "
                            "= 32 MiB, a 20 MiB media item as base64 and then some)")
    sizes.add_argument("--max-upload-bytes", type=int, metavar="BYTES", default=limits.DEFAULT_MAX_UPLOAD_BYTES,
                       help="the largest audio file of a transcription upload (default: %(default)s = 25 MiB)")
    sizes.add_argument("--max-audio-seconds", type=float, metavar="S", default=limits.DEFAULT_MAX_AUDIO_SECONDS,
                       help="the longest audio a transcription request may bring, by its header and by its "
                            "decoded data (default: %(default)s)")
    sizes.add_argument("--max-n", type=int, metavar="N", default=limits.DEFAULT_MAX_N,
                       help="the most choices (n) one request may ask for (default: %(default)s)")
    sizes.add_argument("--frontend-threads", type=int, metavar="N", default=DEFAULT_FRONTEND_THREADS,
                       help="threads that tokenize, render chat templates and decode media and audio, off the "
                            "event loop (default: %(default)s)")
    clients = parser.add_argument_group("slow clients and connections")
    clients.add_argument("--timeout-header", type=float, metavar="S", default=limits.DEFAULT_TIMEOUT_HEADER_S,
                         help="seconds a request's headers may take to arrive before the connection is closed "
                              "(default: %(default)s)")
    clients.add_argument("--timeout-body", type=float, metavar="S", default=limits.DEFAULT_TIMEOUT_BODY_S,
                         help="seconds a request body may pause before a 408 (default: %(default)s)")
    clients.add_argument("--timeout-keep-alive", type=float, metavar="S", default=limits.DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                         help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    clients.add_argument("--max-connections", type=int, metavar="N", default=limits.DEFAULT_MAX_CONNECTIONS,
                         help="open connections past which a new one gets a 503 and is closed (default: "
                              "%(default)s; lowered to what the open-file limit allows)")
    sites = parser.add_argument_group("cross-site requests")
    sites.add_argument("--allowed-origins", nargs="+", action="extend", default=[], metavar="ORIGIN",
                       help="web origins (https://app.example.com, or *) whose pages may POST to the server; "
                            "other pages' POSTs get a 403 (default: none)")
    sites.add_argument("--allowed-hosts", nargs="+", action="extend", default=[], metavar="HOST",
                       help="host names the Host header may name (example.com, *.example.com); others get a 400 "
                            "(default: any)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniwalk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and native routes)",
                                formatter_class=HelpFormatter)
    serve.add_argument("model", nargs="?", default="tiny-qwen3",
                       help="a built-in name (tiny-qwen3, tiny-llama, tiny-qwen3_5, tiny-orpheus, "
                            "tiny-whisper) or a local Hugging Face checkpoint folder (default: %(default)s)")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the name(s) `model` may say on /v1 requests; responses that name none report the "
                            "first (default: MODEL)")
    serve.add_argument("--api-key", default=api_key_from_env(), metavar="KEY",
                       help=f"every route but /health answers 401 without 'Authorization: Bearer KEY' "
                            f"(default: ${API_KEY_ENV}, else none: the server is open)")
    serve.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                       help="API processes (HTTP, tokenization, detokenization) in front of the one engine "
                            "process, sharing the port (vLLM's flag; N > 1 needs --engine-process; each admits its "
                            "share of --max-num-seqs + --max-queue) (default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="uvicorn's log level (omniwalk's own lines stay at info)")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic stats line (every 10 s while busy: running and waiting requests, "
                            "tokens/s in and out, KV cache usage)")
    serve.add_argument("--metrics-compat", default=None, choices=METRICS_COMPAT,
                       help="vllm: /metrics also exports vLLM's names (vllm:num_requests_running, "
                            "vllm:time_to_first_token_seconds, ...) for dashboards built on them (default: none)")
    media = serve.add_argument_group("media (image and audio parts of requests, on a model that takes them)")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="requests may name local files (file:// URLs or paths) under DIR, after symlinks "
                            "(default: none; data: URLs only)")
    media.add_argument("--max-media-bytes", type=int, default=DEFAULT_MAX_MEDIA_BYTES,
                       help="the most bytes one image or audio item may have (default: 20 MiB)")
    _add_limit_flags(serve)
    _add_engine_flags(serve, engine_process=True)

    generate = commands.add_parser("generate", help="generate once, in-process: print the text, write the "
                                   "speech (-o FILE), or transcribe (--audio FILE)",
                                   formatter_class=HelpFormatter, description=generate_doc)
    add_generate_arguments(generate)
    _add_engine_flags(generate, seed=False)

    from omniwalk.bench.cli import add_bench_arguments

    bench = commands.add_parser("bench", help="measure a server (--url) or an in-process engine under load",
                                formatter_class=HelpFormatter)
    add_bench_arguments(bench)
    _add_engine_flags(bench, seed=False)   # in-process only; --seed is the workload's
    return parser


def _engine_args(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> EngineArgs:
    return EngineArgs.from_flags(args, skip)


def _generate(args: argparse.Namespace) -> int:
    from omniwalk.api import Engine
    from omniwalk.server.app import random_weights_banner

    with Engine(_engine_args(args)) as engine:
        if engine.loaded.random_weights:
            print(random_weights_banner(args.model).strip("\n"), file=sys.stderr)
        return run_generate(engine, args)


def main(argv: list[str] | None = None) -> int:
    from omniwalk.bench.client_processes import ClientProcessError
    from omniwalk.engine_process import EngineStartError
    from omniwalk.server.app import PortInUseError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        from omniwalk.bench.cli import check_bench_arguments
        check_bench_arguments(parser, args)
    configure_logging(logging.INFO)
    try:
        if args.command == "serve":
            from omniwalk.server.app import serve
            return serve(args)
        if args.command == "bench":
            from omniwalk.bench.cli import run_bench
            return run_bench(args, sys.argv[1:] if argv is None else argv)
        logging.getLogger().setLevel(logging.WARNING)   # keep `generate`'s stdout to the result
        return _generate(args)
    except ValueError as exc:   # bad flags or a bad request: a message, not a traceback
        print(f"omniwalk: error: {exc}", file=sys.stderr)
        return 2
    except (EngineStartError, PortInUseError, ClientProcessError) as exc:   # the traceback: logged or in exc
        print(f"omniwalk: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # Ctrl-C while loading: the engine process is gone too
        return 130


if __name__ == "__main__":
    sys.exit(main())
