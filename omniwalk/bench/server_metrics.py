"""The server's own view of a run over HTTP: its time-to-first-token series, read from
/metrics before and after (`ServerTTFT`), so a run's TTFT splits into the server's share
(request accepted -> first ids at the API process; docs: omniwalk/server/metrics.py) and the
rest (the load generator, HTTP and the loopback). An omniwalk server only; another server, or
one that does not answer, gives None and the run goes on.

The series are cumulative, so the mean covers every request between the two reads: the
run's warm-up requests too (the JSON says so).
"""

from __future__ import annotations

import httpx

from omniwalk.bench.backends import auth_headers, normalize_base_url

TTFT_SERIES = "omniwalk_time_to_first_token_seconds"


def read_ttft(base_url: str, timeout_s: float = 10.0) -> tuple[float, float] | None:
    """(sum of seconds, count) of the server's TTFT histogram, summed over its labels; None
    when /metrics does not answer or has no such series."""
    try:
        response = httpx.get(normalize_base_url(base_url) + "/metrics", timeout=timeout_s, headers=auth_headers())
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    totals = {"_sum": 0.0, "_count": 0.0}
    found = False
    for line in response.text.splitlines():
        for suffix in totals:
            if line.startswith(TTFT_SERIES + suffix):
                totals[suffix] += float(line.rsplit(" ", 1)[1])
                found = True
    return (totals["_sum"], totals["_count"]) if found else None


class ServerTTFT:
    """`before = ServerTTFT(url)` ahead of a run, `before.mean_ms()` after it."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.start = read_ttft(base_url)

    def mean_ms(self) -> dict | None:
        """{"mean_ms", "count"} of the requests the server saw since, or None."""
        end = read_ttft(self.base_url)
        if self.start is None or end is None or end[1] <= self.start[1]:
            return None
        seconds, count = end[0] - self.start[0], end[1] - self.start[1]
        return {"mean_ms": seconds / count * 1e3, "count": int(count)}
