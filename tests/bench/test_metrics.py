"""The metric math on hand-made traces: known arrival times -> exact figures."""

from __future__ import annotations

import pytest

from omniwalk.bench.backends import RequestRecord
from omniwalk.bench.metrics import Stats, failure, itl_per_chunk, itl_per_token, summarize, tpot, ttft


def record(index, send, arrivals, end, asked, finish="length", **extra) -> RequestRecord:
    r = RequestRecord(index, prompt_len=10 + index, requested_output_len=asked, send_time=send,
                      arrivals=list(arrivals), end_time=end, finish_reason=finish)
    for key, value in extra.items():
        setattr(r, key, value)
    return r


# A: 4 ids in chunks of 1, 2, 1 (and an empty final record); B: 2 ids one by one
A = record(0, 0.0, [(0.1, 1), (0.3, 2), (0.4, 1), (0.45, 0)], 0.45, asked=4)
B = record(1, 1.0, [(1.5, 1), (1.6, 1)], 1.6, asked=2)


def test_per_request_figures():
    assert ttft(A) == pytest.approx(0.1)
    assert tpot(A) == pytest.approx((0.45 - 0.1) / 3)
    # the 0.2 s gap is split over the 2 ids it brought; the empty final record is no arrival
    assert itl_per_token(A) == pytest.approx([0.1, 0.1, 0.1])
    assert itl_per_chunk(A) == pytest.approx([0.2, 0.1])
    assert (ttft(B), tpot(B)) == pytest.approx((0.5, 0.1))
    assert itl_per_token(B) == pytest.approx([0.1])
    one = record(2, 0.0, [(0.2, 1)], 0.2, asked=1)
    assert tpot(one) is None and itl_per_token(one) == [] and ttft(one) == pytest.approx(0.2)


def test_run_summary_exact():
    s = summarize([A, B], start=0.0, end=1.6, ignore_eos=True)
    assert (s.num_requests, s.num_completed, s.num_failed) == (2, 2, 0)
    assert s.output_tokens == s.output_tokens_received == s.requested_output_tokens == 6
    assert s.prompt_tokens == 10 + 11
    assert s.duration_s == pytest.approx(1.6)
    assert s.request_throughput == pytest.approx(2 / 1.6)
    assert s.output_throughput == pytest.approx(6 / 1.6)
    assert s.input_throughput == pytest.approx(21 / 1.6)
    # TTFT samples [0.1, 0.5]: linear interpolation between ranks
    assert (s.ttft.mean, s.ttft.p50, s.ttft.p90, s.ttft.p99) == pytest.approx((0.3, 0.3, 0.46, 0.496))
    assert s.ttft.count == 2
    assert s.tpot.mean == pytest.approx(((0.35 / 3) + 0.1) / 2)
    assert s.itl_per_token.count == 4 and s.itl_per_token.p99 == pytest.approx(0.1)
    # per chunk: [0.2, 0.1, 0.1]
    assert (s.itl_per_chunk.count, s.itl_per_chunk.mean, s.itl_per_chunk.p50, s.itl_per_chunk.p90) == \
        pytest.approx((3, 0.4 / 3, 0.1, 0.18))
    assert (s.e2e.mean, s.e2e.p50, s.e2e.p90) == pytest.approx((0.525, 0.525, 0.585))   # [0.45, 0.6]
    assert s.id_based
    ms = s.to_dict()["latency_ms"]
    assert ms["ttft"]["p90"] == pytest.approx(460.0)


def test_failures_are_counted_and_excluded():
    http_500 = record(2, 0.0, [], 0.1, asked=4, finish=None, error="HTTP 500: boom", http_status=500)
    aborted = record(3, 0.0, [(0.1, 1)], 0.2, asked=4, finish="abort")
    short = record(4, 0.0, [(0.1, 1), (0.2, 1)], 0.2, asked=4, finish="length")
    too_many = record(5, 0.0, [(0.1, 3)], 0.2, asked=2)
    stopped_early = record(6, 0.0, [(0.1, 1)], 0.1, asked=4, finish="stop")   # fine without ignore_eos
    records = [A, B, http_500, aborted, short, too_many, stopped_early]
    s = summarize(records, 0.0, 1.6, ignore_eos=False)
    assert (s.num_errors, s.num_budget_violations, s.num_completed) == (2, 2, 3)
    assert {f["index"]: f["kind"] for f in s.failures} == {2: "error", 3: "error", 4: "budget", 5: "budget"}
    assert s.output_tokens == 4 + 2 + 1                 # completed only
    assert s.output_tokens_received == 4 + 2 + 1 + 2 + 3 + 1
    assert s.ttft.count == 3
    # with ignore_eos a request that stopped short is a budget violation too
    assert failure(stopped_early, ignore_eos=True)[0] == "budget"
    assert failure(stopped_early, ignore_eos=False) is None


def test_counts_without_ids_are_labelled():
    usage_only = record(0, 0.0, [(0.1, None), (0.2, None), (0.3, None)], 0.3, asked=5, usage_output_tokens=5)
    s = summarize([usage_only], 0.0, 0.3, ignore_eos=True)
    assert not s.id_based and "NOT id-based" in s.count_source and "usage" in s.count_source
    assert s.output_tokens == 5 and s.itl_per_token is None
    assert s.itl_per_chunk.count == 2 and s.tpot.mean == pytest.approx(0.2 / 4)
    chunks_only = record(1, 0.0, [(0.1, None), (0.2, None)], 0.2, asked=5)
    assert chunks_only.count_source == "chunks" and chunks_only.output_tokens == 2
    assert failure(chunks_only, ignore_eos=True) is None   # the id count is unknown: not judged


def test_stats_of_nothing():
    assert Stats.of([]) == Stats(0)
    assert Stats.of([]).in_ms()["p50"] is None


def test_the_commit_a_run_names_can_be_given(monkeypatch):
    """The GPU machine's copy of the tree carries a stale .git: OMNIWALK_COMMIT says what ran."""
    from omniwalk.bench.report import machine_info

    monkeypatch.setenv("OMNIWALK_COMMIT", "abc1234")
    assert machine_info()["omniwalk_commit"] == "abc1234"
    monkeypatch.delenv("OMNIWALK_COMMIT")
    assert machine_info()["omniwalk_commit"] != "abc1234"
