"""How busy the load generator was, and `--client-processes N`: the load generator over N
processes.

One asyncio process reading tens of thousands of SSE events/s can use a whole core: the
figures are then its limit, not the server's. Each run over HTTP reports `load_generator`: the number of
processes and the busiest one's CPU seconds per second of its measured phase.

With N processes request i goes to process i % N (warmup too). A closed loop at c gives
each c // N in flight (+1 for the first c % N), so N is capped at c (and at the number of
requests). Under --request-rate every request keeps its due time of the one global
schedule (the cumulative sum of the gaps); a cap on requests in flight is split as c is.
Each process builds its own backend (`make_backend` must pickle: a class or a
`functools.partial` of one), runs its warmup, meets the others at a barrier and starts
its measured phase at one shared time; perf_counter is CLOCK_MONOTONIC, system-wide on
Linux, so the records of all processes merge as they are.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Sequence

from omniwalk.bench.runner import PhaseResult

BUSY = 0.9            # a busiest process at this fraction of a core or more: a warning
START_MARGIN_S = 0.05  # from the barrier to the shared start, for every process to read it


class ClientProcessError(RuntimeError):
    """A load generator process failed (its traceback is in the message)."""


@dataclass(frozen=True)
class LoadGenerator:
    processes: int
    cpu_fraction: float   # the busiest process: CPU seconds / seconds of its measured phase

    def to_dict(self) -> dict:
        return {"processes": self.processes, "cpu_fraction": self.cpu_fraction}

    def lines(self) -> list[str]:
        noun = "process" if self.processes == 1 else "processes"
        lines = [f"  load generator        {self.processes} {noun}, busiest at {self.cpu_fraction:.0%} of a core"]
        if self.cpu_fraction >= BUSY:
            lines.append("  WARNING: the load generator was busy: these figures may be its limit, not the "
                         "server's (try --client-processes)")
        return lines


# ----------------------------------------------------------------------------- the split


def effective_processes(processes: int, concurrency: int | None, num_requests: int) -> int:
    """N capped at the requests in flight (a process with none would send nothing) and at the requests."""
    return max(1, min(processes, concurrency or processes, num_requests))


def split_requests(requests: Sequence, processes: int) -> list[list]:
    """Request i to process i % N."""
    return [list(requests[k::processes]) for k in range(processes)]


def split_concurrency(concurrency: int | None, processes: int) -> list[int | None]:
    """c // N each, +1 for the first c % N processes; no cap stays no cap."""
    if concurrency is None:
        return [None] * processes
    return [concurrency // processes + (k < concurrency % processes) for k in range(processes)]


def split_gaps(gaps: Sequence[float], processes: int) -> list[list[float]]:
    """Each process's gaps: the differences of its requests' due times on the global schedule
    (the first: its first due time)."""
    due = list(itertools.accumulate(gaps))
    out = []
    for k in range(processes):
        mine = due[k::processes]
        out.append([b - a for a, b in zip([0.0] + mine, mine)])
    return out


def merge(parts: list[PhaseResult]) -> PhaseResult:
    """One phase from the processes' phases: first send to last completion, records in order."""
    records = sorted((r for part in parts for r in part.records), key=lambda r: r.index)
    return PhaseResult(records, min(p.start for p in parts), max(p.end for p in parts),
                       sum(p.cpu_seconds for p in parts))


# ----------------------------------------------------------------------------- running


def run_phases(make_backend, warmup, measured, gaps, concurrency, label: str, show_progress: bool,
               processes: int = 1) -> tuple[PhaseResult | None, PhaseResult, LoadGenerator]:
    """(warmup or None, measured phase, how busy the load generator was): in this process, or
    spread over `processes` (capped as `effective_processes` says)."""
    from omniwalk.bench.cli import _phases

    n = effective_processes(processes, concurrency, len(measured))
    if n == 1:
        warm, result = asyncio.run(_phases(make_backend, warmup, measured, gaps, concurrency, label,
                                           show_progress))
        return warm, result, LoadGenerator(1, result.cpu_fraction)
    outcomes = _run_children(make_backend, warmup, measured, gaps, concurrency, n)
    warm_parts = [w for w, _ in outcomes if w is not None]
    warm = merge(warm_parts) if warm_parts else None
    result = merge([r for _, r in outcomes])
    if show_progress:
        for name, phase in ((f"{label} warmup", warm), (label, result)):
            if phase is not None:
                _done_line(name, phase, n)
    return warm, result, LoadGenerator(n, max(r.cpu_fraction for _, r in outcomes))


def _done_line(label: str, phase: PhaseResult, processes: int) -> None:
    failed = sum(r.error is not None for r in phase.records)
    print(f"{label}: {len(phase.records)} requests{f', {failed} FAILED' if failed else ''}, "
          f"{sum(r.output_tokens for r in phase.records)} output ids, {phase.duration:.1f} s "
          f"({processes} client processes)", file=sys.stderr, flush=True)


def _run_children(make_backend, warmup, measured, gaps, concurrency, n: int) -> list:
    """[(warmup or None, measured phase)] of each process, in process order."""
    context = multiprocessing.get_context("spawn")
    barrier, start, results = context.Barrier(n), context.Value("d", 0.0), context.Queue()
    warmups, requests = split_requests(warmup, n), split_requests(measured, n)
    schedules, slots = split_gaps(gaps, n), split_concurrency(concurrency, n)
    children = [context.Process(target=_child, name=f"omniwalk-bench-client-{k}", daemon=True,
                                args=(k, results, barrier, start, make_backend, warmups[k], requests[k],
                                      schedules[k], slots[k]))
                for k in range(n)]
    for child in children:
        child.start()
    try:
        return _collect(children, results, barrier)
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.terminate()
                child.join()


def _collect(children, results, barrier) -> list:
    outcomes, suspects = {}, set()
    while len(outcomes) < len(children):
        try:
            k, outcome = results.get(timeout=0.5)
        except queue.Empty:
            # a process gone without its outcome (killed): given one more poll for what it sent
            dead = {k for k, c in enumerate(children) if k not in outcomes and c.exitcode is not None}
            if dead & suspects:
                barrier.abort()
                k = min(dead & suspects)
                raise ClientProcessError(f"client process {k} exited (status {children[k].exitcode}) "
                                         "without its records") from None
            suspects = dead
            continue
        if isinstance(outcome, str):   # its traceback
            barrier.abort()            # the others, waiting to start the measured phase, stop
            raise ClientProcessError(f"client process {k} failed:\n{outcome.rstrip()}")
        outcomes[k] = outcome
    return [outcomes[k] for k in range(len(children))]


def _child(k, results, barrier, start, make_backend, warmup, measured, gaps, concurrency) -> None:
    """One load generator process: its warmup, the barrier, its measured phase from the shared
    start; puts (k, (warmup, measured)) or (k, its traceback) on `results`. Prints nothing."""
    from omniwalk.bench.cli import _phases

    def meet():
        if barrier.wait() == 0:
            start.value = time.perf_counter() + START_MARGIN_S
        barrier.wait()
        time.sleep(max(0.0, start.value - time.perf_counter()))

    try:
        outcome = asyncio.run(_phases(make_backend, warmup, measured, gaps, concurrency, "", False,
                                      before_measured=meet))
    except BaseException:   # noqa: BLE001 - the parent reports it
        outcome = traceback.format_exc()
    results.put((k, outcome))
