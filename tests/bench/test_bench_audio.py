"""`omniwalk bench --audio-seconds`: audio in, text out. Each request carries one seeded clip:
in-process as one AudioInput of float32 samples, over HTTP as a WAV data URL on /generate."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from omniwalk.bench.backends import InProcessBackend, NativeGenerateBackend
from omniwalk.bench.cli import resolve_tokenizer
from omniwalk.bench.metrics import summarize
from omniwalk.bench.runner import run_phase
from omniwalk.bench.workload import (
    MEASURED, SAMPLE_RATE, LengthRange, normal_vocabulary, synthetic_requests, with_audio,
)
from omniwalk.capabilities.media import AudioInput
from omniwalk.cli import main


def audio_workload(num: int, seconds: float, data_urls: bool, seed: int = 0):
    vocabulary = normal_vocabulary(resolve_tokenizer("tiny-qwen3"))
    requests = synthetic_requests(num, LengthRange(6, 6), LengthRange(2, 4), vocabulary, seed, MEASURED)
    return with_audio(requests, seconds, seed, MEASURED, data_urls)


def decode_wav_url(url: str) -> tuple[np.ndarray, int]:
    prefix = "data:audio/wav;base64,"
    assert url.startswith(prefix)
    wav = base64.b64decode(url[len(prefix):])
    assert soundfile.info(io.BytesIO(wav)).subtype == "PCM_16"
    return soundfile.read(io.BytesIO(wav), dtype="float32")


def test_http_payload_carries_a_wav_of_the_clip():
    [request] = audio_workload(1, 2.5, data_urls=True)
    body = NativeGenerateBackend("http://nowhere/v1", ignore_eos=True).payload(request)
    assert body["prompt_token_ids"] == request.prompt_token_ids and body["stream"] is True
    assert body["max_output_tokens"] == request.output_len and body["ignore_eos"] is True
    [url] = body["audios"]
    samples, rate = decode_wav_url(url)
    assert rate == SAMPLE_RATE and samples.shape == (int(2.5 * SAMPLE_RATE),)
    np.testing.assert_allclose(samples, request.audio, atol=2 / 32768)   # the same clip, 16-bit


@pytest.mark.parametrize("lines, error", [
    ([{"token_ids": [7]}, {"token_ids": [], "finish_reason": "error", "error": "audio: not a WAV"}],
     "error: audio: not a WAV"),
    ([{"token_ids": [7]}], "the stream ended without a finish_reason"),
    (["not json"], "malformed line"),
])
def test_http_failures_are_recorded(lines, error):
    def answer(request: httpx.Request) -> httpx.Response:
        text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
        return httpx.Response(200, text=text)

    async def go():
        backend = NativeGenerateBackend("http://nowhere", True, transport=httpx.MockTransport(answer))
        try:
            return await backend.send(audio_workload(1, 0.1, data_urls=True)[0])
        finally:
            await backend.aclose()

    record = asyncio.run(go())
    assert record.error.startswith(error) and record.end_time is not None


class FakeEngine:
    """`submit` keeps the request and streams `max_tokens` ids, one per chunk."""

    def __init__(self):
        self.requests = []

    def submit(self, generation, loop):
        self.requests.append(generation)

        async def chunks():
            for i in range(generation.max_tokens):
                await asyncio.sleep(0)
                last = i == generation.max_tokens - 1
                yield SimpleNamespace(token_ids=[7], finished=last, finish_reason="length" if last else None,
                                      error=None)
        return chunks()


def test_in_process_request_carries_one_audio_input():
    requests = audio_workload(3, 0.5, data_urls=False)
    engine = FakeEngine()
    result = asyncio.run(run_phase(InProcessBackend(engine, ignore_eos=True), requests, [0.0] * 3, 2))
    for request, generation in zip(requests, engine.requests):
        assert generation.prompt_token_ids == request.prompt_token_ids
        assert generation.max_tokens == request.output_len
        [audio] = generation.media
        assert isinstance(audio, AudioInput) and audio.data is request.audio
    summary = summarize(result.records, result.start, result.end, ignore_eos=True)
    assert summary.num_completed == 3 and summary.audio_seconds == pytest.approx(1.5)
    assert summary.audio_seconds_per_s == pytest.approx(1.5 / summary.duration_s)


def fake_generate_server(bodies: list) -> FastAPI:
    """/generate as omniwalk's native route streams it (NDJSON): `max_output_tokens` ids, one a line."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        bodies.append(body)
        count = body["max_output_tokens"]

        async def lines():
            for i in range(count):
                line = {"id": "gen-1", "token_ids": [7], "text": "x"}
                if i == count - 1:
                    line.update(finish_reason="length",
                                usage={"prompt_tokens": len(body["prompt_token_ids"]), "output_tokens": count})
                yield json.dumps(line) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def test_cli_over_http_sends_clips_to_generate(serve, tmp_path, capsys):
    bodies: list[dict] = []
    path = tmp_path / "bench.json"
    with serve(fake_generate_server(bodies)) as url:
        code = main(["bench", "--url", url, "--model", "fake", "--tokenizer", "tiny-qwen3", "--concurrency", "2",
                     "--input-len", "6", "--output-len", "2:4", "--num-requests", "4", "--warmup", "1",
                     "--audio-seconds", "1.5", "--ignore-eos", "--json", str(path), "--no-progress"])
    assert code == 0, capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["config"]["audio_seconds"] == 1.5 and "/generate" in report["config"]["target"]
    s = report["runs"][0]["summary"]
    assert s["num_completed"] == 4 and s["id_based"]
    assert s["audio_seconds"] == pytest.approx(4 * 1.5)
    assert s["audio_seconds_per_s"] == pytest.approx(s["audio_seconds"] / s["duration_s"])
    assert len(bodies) == 5   # the warmup request, then the measured ones
    measured = {tuple(r.prompt_token_ids): r for r in audio_workload(4, 1.5, data_urls=False)}
    for body in bodies[1:]:
        samples, rate = decode_wav_url(body["audios"][0])
        assert rate == SAMPLE_RATE and len(samples) == 1.5 * SAMPLE_RATE
        clip = measured[tuple(body["prompt_token_ids"])].audio
        np.testing.assert_allclose(samples, clip, atol=2 / 32768)
    assert "audio s / s" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--audio-seconds", "0"], "--audio-seconds must be > 0"),
    (["--audio-seconds", "601"], "<= 600"),
    (["--audio-seconds", "2", "--baseline", "hf", "--concurrency", "1"], "text-only baseline"),
    (["--audio-seconds", "2", "--tts"], "not --tts"),
])
def test_bad_audio_flags_are_refused(flags, message, capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", "--model", "fake", "--tokenizer", "tiny-qwen3",
                 *flags]) == 2
    assert message in capsys.readouterr().err
