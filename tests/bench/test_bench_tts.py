"""`omniwalk bench --tts`: exact counts against the real tiny-orpheus server and in-process,
failures of a fake speech server counted, and the viability / RTF arithmetic."""

from __future__ import annotations

import base64
import itertools
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from omniwalk.bench.tts import tts_requests
from omniwalk.bench.tts_backends import TTSRecord, base64_size
from omniwalk.bench.tts_metrics import is_viable, latest_chunk, rtf, stall, summarize_tts
from omniwalk.bench.workload import MEASURED, WARMUP, LengthRange
from omniwalk.cli import main
from omniwalk.models.orpheus.model import samples_received

TINY_FRAME = 64     # samples per frame of tiny-orpheus' SNAC


def bench(tmp_path, *flags) -> tuple[int, dict]:
    path = tmp_path / "tts.json"
    code = main(["bench", "--tts", *flags, "--json", str(path), "--no-progress"])
    return code, json.loads(path.read_text())


def expected(num: int, output_len: str, seed: int, stream: int = MEASURED) -> tuple[int, int]:
    """(codes, samples) the workload asks for with ignore_eos: every code, F * S samples."""
    requests = tts_requests(num, LengthRange.parse(output_len), seed, stream)
    return (sum(r.max_output_tokens for r in requests),
            sum(samples_received(r.max_output_tokens // 7, TINY_FRAME) for r in requests))


@pytest.mark.slow
def test_real_server_counts_exactly(orpheus_server, metric, tmp_path, capsys):
    codes_before = metric(orpheus_server, "omniwalk_generation_tokens_total")
    code, report = bench(tmp_path, "--url", orpheus_server + "/v1", "--concurrency", "1,4", "--output-len", "5:80",
                         "--num-requests", "8", "--warmup", "1", "--ignore-eos", "--seed", "3", "--voice", "leo")
    out = capsys.readouterr().out
    assert code == 0, out
    codes, samples = expected(8, "5:80", 3)
    assert report["mode"] == "tts" and report["config"]["model"] == "tiny-orpheus"
    assert [run["concurrency"] for run in report["runs"]] == [1, 4]
    for run in report["runs"]:
        s = run["summary"]
        assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (8, 8, 0)
        assert s["codes"] == s["requested_codes"] == codes
        assert s["samples"] == s["samples_received"] == samples
        assert s["audio_seconds"] == pytest.approx(samples / 24000)
        assert s["latency_ms"]["ttfa"]["count"] == s["num_with_audio"] == s["rtf"]["count"]
        assert s["num_with_audio"] == 8 - sum(r.max_output_tokens < 7 for r in tts_requests(
            8, LengthRange.parse("5:80"), 3, MEASURED))
        assert 0 <= s["num_viable"] <= s["num_with_audio"] and s["audio_throughput"] > 0
        assert run["warmup"] == {"num_requests": 1, "num_failed": 0, "failures": []}
    warmup_codes, _ = expected(1, "5:80", 3, WARMUP)
    sent = metric(orpheus_server, "omniwalk_generation_tokens_total") - codes_before
    assert sent == 2 * (codes + warmup_codes)     # what the server says it generated
    assert "RTF" in report["definitions"] and "TTFA" in report["definitions"]
    assert "< 1: faster than real time" in out and "streaming viable" in out and "FAILED" not in out


def test_in_process(tmp_path):
    code, report = bench(tmp_path, "--model", "tiny-orpheus", "--concurrency", "3", "--output-len", "30",
                         "--num-requests", "4", "--ignore-eos", "--max-num-seqs", "2")
    assert code == 0
    s = report["runs"][0]["summary"]
    assert (s["num_completed"], s["codes"], s["samples"]) == (4, 120, 4 * samples_received(4, TINY_FRAME))
    assert report["config"]["engine_args"]["max_num_seqs"] == 2


# ----------------------------------------------------------------------------- a failing fake server


def fake_speech_server(behaviour) -> FastAPI:
    """/v1/audio/speech as SSE: 7 frames of 10 samples per request, unless `behaviour(n)`
    (n = 1, 2, ... in arrival order) says "500", "error-event", "no-done", "short" (one
    delta lost: fewer samples than the usage), or "over" (more codes than asked)."""
    app = FastAPI()
    counter = itertools.count(1)

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        body = await request.json()
        kind = behaviour(next(counter))
        if kind == "500":
            return JSONResponse({"error": {"message": "injected failure", "code": 500}}, status_code=500)
        codes = body["max_output_tokens"] + (kind == "over")
        frames = codes // 7

        async def events():
            for frame in range(frames):
                if kind == "error-event" and frame == 1:
                    yield 'data: {"type": "error", "error": {"message": "died mid-stream", "code": 500}}\n\n'
                    return
                if not (kind == "short" and frame == 0):
                    audio = base64.b64encode(bytes(20)).decode()
                    yield f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': audio})}\n\n"
            if kind == "no-done":
                return
            usage = {"input_tokens": 5, "output_tokens": codes, "total_tokens": codes + 5, "codes": codes,
                     "frames": frames, "samples": 10 * frames}
            yield f"data: {json.dumps({'type': 'speech.audio.done', 'finish_reason': 'length', 'usage': usage})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_failures_are_counted_and_exit_nonzero(serve, tmp_path, capsys):
    kinds = {3: "500", 4: "error-event", 5: "no-done", 6: "short", 7: "over"}
    with serve(fake_speech_server(lambda n: kinds.get(n, "ok"))) as url:
        code, report = bench(tmp_path, "--url", url, "--model", "fake", "--concurrency", "1",
                             "--output-len", "49", "--num-requests", "9", "--ignore-eos")
    assert code == 1
    s = report["runs"][0]["summary"]
    assert (s["num_requests"], s["num_errors"], s["num_budget_violations"], s["num_completed"]) == (9, 3, 2, 4)
    assert s["samples"] == 4 * 70 and s["codes"] == 4 * 49
    assert sorted(f["http_status"] for f in s["failures"] if f["kind"] == "error") == [200, 200, 500]
    messages = " ".join(f["message"] for f in s["failures"])
    assert "usage says" in messages and "50 output tokens" in messages and "without speech.audio.done" in messages
    assert report["failed"] and report["num_failed"] == 5
    assert "BENCHMARK FAILED: 5 of 9 requests failed" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the arithmetic


def record(arrivals, end, sample_rate=100) -> TTSRecord:
    samples = sum(n for _, n in arrivals)
    r = TTSRecord(0, 14, send_time=0.0, arrivals=list(arrivals), end_time=end, finish_reason="length",
                  sample_rate=sample_rate)
    r.usage = {"output_tokens": 14, "codes": 14, "frames": 2, "samples": samples}
    return r


def test_viability_stall_and_rtf():
    # chunks of 0.5 s of audio (50 samples at 100 Hz); playback starts at 1.0
    on_time = record([(1.0, 50), (1.5, 50), (1.9, 50)], end=2.0)
    late = record([(1.0, 50), (1.5, 50), (2.25, 50)], end=2.5)      # deadline of chunk 3: 2.0
    assert is_viable(on_time) and stall(on_time) == 0.0
    assert not is_viable(late) and stall(late) == pytest.approx(0.25)
    assert latest_chunk(on_time) is None and latest_chunk(late) == 2
    assert rtf(on_time) == pytest.approx(2.0 / 1.5) and rtf(late) == pytest.approx(2.5 / 1.5)
    silent = record([], end=0.3)
    assert is_viable(silent) is None and rtf(silent) is None
    s = summarize_tts([on_time, late, silent], 0.0, 2.5, ignore_eos=False)
    assert (s.num_completed, s.num_with_audio, s.num_viable, s.viable_fraction) == (3, 2, 1, 0.5)
    assert s.audio_seconds == pytest.approx(3.0) and s.audio_throughput == pytest.approx(3.0 / 2.5)
    assert base64_size(base64.b64encode(bytes(7)).decode()) == 7
    assert base64_size(base64.b64encode(bytes(8)).decode()) == 8
