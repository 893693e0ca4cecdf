"""The periodic stats line of `omniwalk serve`, like vLLM's (off with `--disable-log-stats`):

    ... INFO omniwalk.server.stats_log: Avg prompt throughput: 512.0 tokens/s, Avg generation
    throughput: 1024.0 tokens/s, Running: 32 reqs, Waiting: 4 reqs, KV cache usage: 12.5%

and, on a model that produces audio, `Avg audio throughput: 96.0 audio s/s` after the
generation rate (a spoken answer goes on after its text: its audio is its progress then)

every `interval_s` (10 s) while the server has work, plus one line after it turns idle
(so the last interval's rates are seen and the idle state is on record); nothing while
idle. Token rates are the server's counts over the interval (prompt tokens of admitted
requests, output ids received: the same counts as /metrics); Running, Waiting and KV
usage are the engine loop's last stats (its process sends them with each step).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from omniwalk.api import Engine
from omniwalk.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 10.0


class StatsLogger:
    def __init__(self, engine: Engine, metrics: ServerMetrics, interval_s: float = STATS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.metrics = metrics
        self.interval_s = interval_s
        self.clock = clock
        self._since = clock()
        self._prompt_tokens = metrics.total_prompt_tokens
        self._generation_tokens = metrics.total_generation_tokens
        self._audio_samples = metrics.total_audio_samples_out
        self._last_line_busy = False

    def tick(self) -> str | None:
        """Log the line for the interval since the last tick, if there was work; the line, or None."""
        now = self.clock()
        elapsed = max(now - self._since, 1e-9)
        prompt = self.metrics.total_prompt_tokens - self._prompt_tokens
        generation = self.metrics.total_generation_tokens - self._generation_tokens
        audio_samples = self.metrics.total_audio_samples_out - self._audio_samples
        stats = self.engine.stats
        busy = bool(stats.num_running or stats.num_waiting or self.engine.num_in_flight or prompt or generation
                    or audio_samples)
        self._since, self._prompt_tokens = now, self.metrics.total_prompt_tokens
        self._generation_tokens = self.metrics.total_generation_tokens
        self._audio_samples = self.metrics.total_audio_samples_out
        if not busy and not self._last_line_busy:
            return None
        self._last_line_busy = busy
        kv_usage = stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
        audio = ""
        if self.metrics.audio_output_seconds is not None:
            seconds = audio_samples / self.metrics.speech_sampling_rate
            audio = f"Avg audio throughput: {seconds / elapsed:.1f} audio s/s, "
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{generation / elapsed:.1f} tokens/s, {audio}Running: {stats.num_running} reqs, Waiting: "
                f"{stats.num_waiting} reqs, KV cache usage: {kv_usage:.1%}")
        logger.info(line)
        return line

    async def run(self) -> None:
        """Tick every `interval_s` until cancelled (a task of the server's lifespan)."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick()
