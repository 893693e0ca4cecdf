"""Drive one phase of a benchmark: send requests on their schedule, collect the records.

One loop covers both arrival models:

    closed loop at c       every gap 0, at most c in flight: a new request the moment one ends
    Poisson at rate r      seeded exponential gaps; optionally at most c in flight (a request
                           whose time has come waits for a free slot, and later ones shift with it)
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Sequence, TextIO

from omniwalk.bench.backends import Backend, RequestRecord
from omniwalk.bench.workload import BenchRequest


@dataclass
class PhaseResult:
    records: list[RequestRecord]
    start: float   # perf_counter when the first request was sent
    end: float     # perf_counter when the last request was complete
    cpu_seconds: float = 0.0   # this process's CPU time over the phase (time.process_time)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def cpu_fraction(self) -> float:
        """How busy the sending process was: its CPU seconds per second of the phase (1.0: a core)."""
        return self.cpu_seconds / self.duration if self.duration > 0 else 0.0


class Progress:
    """A one-line progress report on stderr, rewritten in place (final line only when not a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool = True, stream: TextIO | None = None):
        self.label = label
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interactive = enabled and self.stream.isatty()
        self.done = self.failed = self.tokens = 0
        self.started = time.perf_counter()
        self._last_draw = 0.0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += record.error is not None
        self.tokens += record.output_tokens
        if self.interactive and (time.perf_counter() - self._last_draw > 0.1 or self.done == self.total):
            self._draw("\r")

    def close(self) -> None:
        if self.enabled:
            self._draw("\r" if self.interactive else "")
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, prefix: str) -> None:
        self._last_draw = time.perf_counter()
        width = 30
        filled = width * self.done // max(self.total, 1)
        failed = f", {self.failed} FAILED" if self.failed else ""
        self.stream.write(f"{prefix}{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                          f"{self.done}/{self.total} requests{failed}, {self.tokens} output ids, "
                          f"{self._last_draw - self.started:.1f} s")
        self.stream.flush()


async def run_phase(backend: Backend, requests: Sequence[BenchRequest], gaps: Sequence[float],
                    max_in_flight: int | None, progress: Progress | None = None) -> PhaseResult:
    """Send `requests[i]` `gaps[i]` seconds after the previous send (and once a slot is free)."""
    if len(gaps) != len(requests):
        raise ValueError("one gap per request")
    slots = asyncio.Semaphore(max_in_flight) if max_in_flight else None

    async def one(request: BenchRequest) -> RequestRecord:
        try:
            record = await backend.send(request)
        finally:
            if slots is not None:
                slots.release()
        if progress is not None:
            progress.update(record)
        return record

    loop = asyncio.get_running_loop()
    cpu, start = time.process_time(), time.perf_counter()
    due = loop.time()
    tasks = []
    for request, gap in zip(requests, gaps):
        due += gap
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        if slots is not None:
            await slots.acquire()
        tasks.append(asyncio.create_task(one(request)))
    records = list(await asyncio.gather(*tasks))
    if progress is not None:
        progress.close()
    start = min((r.send_time for r in records), default=start)
    end = max((r.end_time for r in records if r.end_time is not None), default=time.perf_counter())
    return PhaseResult(records, start, end, time.process_time() - cpu)
