"""Workloads (seeded prompts, lengths, files, clips, arrivals) and the phase driver's concurrency."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from omniwalk.bench.backends import RequestRecord
from omniwalk.bench.cli import parse_concurrency, resolve_tokenizer
from omniwalk.bench.runner import run_phase
from omniwalk.bench.workload import (
    MEASURED, WARMUP, BenchRequest, LengthRange, arrival_gaps, check_audio_seconds, file_requests,
    normal_vocabulary, read_prompts, synthetic_requests, with_audio,
)


@pytest.fixture(scope="module")
def tokenizer():
    return resolve_tokenizer("tiny-qwen3")


def test_length_ranges():
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("100:200") == LengthRange(100, 200)
    assert str(LengthRange.parse("100:200")) == "100:200"
    for bad in ("0", "5:4", "a", "1:2:3"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)
    rng = np.random.default_rng(0)
    draws = {LengthRange(3, 5).draw(rng) for _ in range(200)}
    assert draws == {3, 4, 5}


def test_synthetic_prompts_are_seeded_and_avoid_special_ids(tokenizer):
    vocabulary = normal_vocabulary(tokenizer)
    special = set(tokenizer.all_special_ids)
    assert special and not special & set(vocabulary.tolist())
    make = lambda seed, stream=MEASURED: synthetic_requests(  # noqa: E731
        50, LengthRange(4, 9), LengthRange(2, 6), vocabulary, seed, stream)
    first = make(7)
    assert first == make(7)
    assert first != make(8) and first != make(7, WARMUP)
    assert all(4 <= r.prompt_len <= 9 and 2 <= r.output_len <= 6 for r in first)
    ids = {t for r in first for t in r.prompt_token_ids}
    assert not ids & special and max(ids) < tokenizer.vocab_size
    assert [r.index for r in first] == list(range(50))


def test_prompts_file_lines_and_jsonl(tmp_path, tokenizer):
    plain = tmp_path / "prompts.txt"
    plain.write_text("hello world\n\nthe cat\n")
    assert read_prompts(plain) == ["hello world", "the cat"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": [5, 6, 7]}) + "\n")
    prompts = read_prompts(jsonl)
    assert prompts == ["hello", [5, 6, 7]]
    requests = file_requests(prompts, tokenizer, 5, LengthRange(3, 3), seed=0)
    assert [r.prompt_token_ids for r in requests[1::2]] == [[5, 6, 7], [5, 6, 7]]   # cycled in order
    assert requests[0].prompt_token_ids == tokenizer.encode("hello")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        read_prompts(bad)


def test_arrival_gaps():
    assert arrival_gaps(4, None, seed=0) == [0.0] * 4
    gaps = arrival_gaps(4000, 20.0, seed=1)
    assert gaps == arrival_gaps(4000, 20.0, seed=1) and gaps != arrival_gaps(4000, 20.0, seed=2)
    assert gaps[0] == 0.0 and min(gaps[1:]) > 0
    assert np.mean(gaps[1:]) == pytest.approx(1 / 20.0, rel=0.1)
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, seed=0)


def test_parse_concurrency():
    assert parse_concurrency("1,32,128") == [1, 32, 128]
    assert parse_concurrency(None) is None
    for bad in ("0", "a,b", ""):
        with pytest.raises(ValueError):
            parse_concurrency(bad)


class SleepyBackend:
    """Answers each request after `delay` s, tracking how many were in flight at once."""

    name = "sleepy"

    def __init__(self, delay: float):
        self.delay = delay
        self.in_flight = self.peak = 0

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord(request.index, request.prompt_len, request.output_len, send_time=_now())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        record.arrivals.append((_now(), request.output_len))
        record.end_time, record.finish_reason = _now(), "length"
        return record

    async def aclose(self) -> None:
        pass


def _now():
    import time
    return time.perf_counter()


@pytest.mark.parametrize("cap, rate", [(3, None), (2, 200.0), (None, 200.0)])
def test_phase_respects_concurrency(cap, rate):
    requests = [BenchRequest(i, [5], 1) for i in range(12)]
    backend = SleepyBackend(0.02)
    result = asyncio.run(run_phase(backend, requests, arrival_gaps(12, rate, seed=0), cap))
    assert [r.index for r in result.records] == list(range(12))
    if cap is not None:
        assert backend.peak == cap
    assert result.duration > 0


def test_audio_clips_are_seeded_per_request_and_of_the_asked_length():
    requests = [BenchRequest(i, [5, 6], 3) for i in range(3)]
    first = with_audio(requests, 1.25, seed=4)
    assert first == requests   # the prompts and budgets are untouched
    assert all(r.audio.dtype == np.float32 and r.audio.shape == (20000,) for r in first)
    assert all(r.audio_seconds == 1.25 and r.audio_url is None for r in first)
    assert all(0 < np.abs(r.audio).max() < 1 for r in first)
    again = with_audio(requests, 1.25, seed=4)
    assert all(np.array_equal(a.audio, b.audio) for a, b in zip(first, again))
    assert not np.array_equal(first[0].audio, first[1].audio)   # one clip per request
    other_seed, warmup = with_audio(requests, 1.25, seed=5), with_audio(requests, 1.25, seed=4, stream=WARMUP)
    assert not np.array_equal(first[0].audio, other_seed[0].audio)
    assert not np.array_equal(first[0].audio, warmup[0].audio)
    # request i's clip does not depend on how many requests there are
    assert np.array_equal(with_audio(requests[2:], 1.25, seed=4)[0].audio, first[2].audio)
    assert BenchRequest(0, [5], 1).audio_seconds == 0.0


@pytest.mark.parametrize("seconds", [0.0, -1.0, 600.5, float("nan")])
def test_audio_seconds_out_of_range(seconds):
    with pytest.raises(ValueError, match="--audio-seconds"):
        check_audio_seconds(seconds)
    check_audio_seconds(600.0)
