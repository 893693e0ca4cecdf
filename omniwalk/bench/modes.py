"""What the `omniwalk bench` modes with records of their own (--tts, --speak) do alike: the
in-process engine, the concurrency list, one measured run per concurrency after its warmup,
the JSON document and the exit status. A mode brings its workload, its backends and a
`ModeFigures` (how its records become figures).

    with in_process_engine(args, "speech") as (engine, description): ...
    run_mode(args, argv, figures, backend_factory, warmup, measured, config)
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

from omniwalk.bench.cli import _arrival_label, _engine_args, _gpu_peak, _where, parse_concurrency
from omniwalk.bench.client_processes import run_phases
from omniwalk.bench.report import (
    exit_status, format_definitions, machine_info, now_iso, run_summary_where, write_json,
)
from omniwalk.bench.runner import PhaseResult
from omniwalk.bench.workload import arrival_gaps


@dataclass(frozen=True)
class ModeFigures:
    """How one mode's records become figures. `summarize(records, start, end, ignore_eos)`
    returns a summary with `to_dict()`, `num_requests`, `num_failed` and `failures`."""

    name: str                                   # the JSON's `mode`: "tts", "speak"
    flag: str                                   # how the mode is asked for: "--tts"
    summarize: Callable[..., Any]
    format_summary: Callable[[str, Any], str]   # (title, summary) -> the printed table
    definitions: dict[str, str]


@contextlib.contextmanager
def in_process_engine(args: argparse.Namespace, what: str = ""):
    """Yields (the Engine of the bench's engine flags, a line describing it); shuts it down after."""
    from omniwalk.api import Engine

    engine = Engine(_engine_args(args))
    try:
        loaded = engine.loaded
        kind = f" {what}" if what else ""
        yield engine, (f"in-process {loaded.name}{kind} ({loaded.dtype}, {loaded.device}, max_num_seqs "
                       f"{engine.args.max_num_seqs}, engine loop {_where(engine)})")
    finally:
        engine.shutdown()


def resolve_concurrencies(args: argparse.Namespace) -> list[int | None]:
    """--concurrency as a list; without it one closed-loop run at 1, or none at all under --request-rate."""
    concurrencies = parse_concurrency(args.concurrency)
    if concurrencies is None:
        concurrencies = [None] if args.request_rate is not None else [1]
    return concurrencies


def run_mode(args: argparse.Namespace, argv: list[str] | None, figures: ModeFigures, backend_factory,
             warmup: list, measured: list, config: dict) -> int:
    """Every run of the mode: `backend_factory(args)` yields (target, engine or None, make_backend);
    `config` is what the JSON says about the workload. The exit status: 0, or 1 when any
    request (warmup included) failed."""
    concurrencies = resolve_concurrencies(args)
    runs = []
    with backend_factory(args) as (target, engine, make_backend):
        print(f"target: {target}", flush=True)
        if engine is not None and max(c or 0 for c in concurrencies) > engine.args.max_num_seqs:
            print(f"note: concurrency above --max-num-seqs {engine.args.max_num_seqs}: the excess queues",
                  file=sys.stderr)
        for concurrency in concurrencies:
            runs.append(_one_run(args, figures, engine, make_backend, warmup, measured, concurrency))
        engine_args = asdict(engine.args) if engine is not None else None

    print(format_definitions(figures.definitions))
    failed = sum(r["summary"]["num_failed"] + ((r["warmup"] or {}).get("num_failed") or 0) for r in runs)
    sent = sum(r["summary"]["num_requests"] + ((r["warmup"] or {}).get("num_requests") or 0) for r in runs)
    if args.json:
        argv = list(sys.argv[1:] if argv is None else argv)
        write_json(args.json, {
            "command": "omniwalk " + shlex.join(argv), "argv": argv, "date": now_iso(), "mode": figures.name,
            "machine": machine_info(),
            "config": {"target": target, "url": args.url, "model": args.model, "engine_args": engine_args,
                       **config, "warmup": args.warmup, "seed": args.seed, "ignore_eos": args.ignore_eos,
                       "concurrency": concurrencies, "request_rate": args.request_rate,
                       "client_processes": args.client_processes},
            "definitions": figures.definitions, "failed": failed > 0, "num_failed": failed, "runs": runs,
        })
    return exit_status(failed, sent, run_summary_where(runs))


def _one_run(args, figures: ModeFigures, engine, make_backend, warmup, measured, concurrency) -> dict:
    label = _arrival_label(concurrency, args.request_rate)
    gaps = arrival_gaps(len(measured), args.request_rate, args.seed)
    _gpu_peak(engine, reset=True)
    warm, result, load = run_phases(make_backend, warmup, measured, gaps, concurrency, label,
                                    not args.no_progress, args.client_processes)
    load = None if engine is not None else load   # in-process the engine shares the process: no meaning
    summary = figures.summarize(result.records, result.start, result.end, args.ignore_eos)
    gpu_peak = _gpu_peak(engine, reset=False)
    table = figures.format_summary(f"omniwalk bench {figures.flag}: {label}", summary)
    if gpu_peak is not None:
        table += f"\n  GPU peak allocated    {gpu_peak / 2**30:.2f} GiB"
    if load is not None:
        table += "\n" + "\n".join(load.lines())
    print(table, flush=True)
    warm_summary = _warmup_summary(figures, warm, args.ignore_eos)
    if warm_summary and warm_summary["num_failed"]:
        print(f"  WARMUP: {warm_summary['num_failed']} of {warm_summary['num_requests']} requests failed",
              flush=True)
    return {"concurrency": concurrency, "request_rate": args.request_rate, "arrivals": label,
            "summary": summary.to_dict(), "warmup": warm_summary, "gpu_peak_allocated_bytes": gpu_peak,
            "load_generator": None if load is None else load.to_dict()}


def _warmup_summary(figures: ModeFigures, warm: PhaseResult | None, ignore_eos: bool) -> dict | None:
    if warm is None:
        return None
    summary = figures.summarize(warm.records, warm.start, warm.end, ignore_eos)
    return {"num_requests": summary.num_requests, "num_failed": summary.num_failed, "failures": summary.failures}
