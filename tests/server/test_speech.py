"""Text to speech over loopback HTTP on tiny-orpheus: POST /v1/audio/speech (the official
openai client, files, chunked audio, SSE), /generate with audio, the SDK, the budget
(exact codes, the documented sample count, streamed bytes == non-streamed bytes),
32 concurrent requests, bad input, disconnects, and errors after a stream started."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct

import httpx
import pytest
import soundfile

from omniwalk.capabilities import Capability
from omniwalk.client import AsyncClient, Client, ServerError
from omniwalk.loading import EngineArgs
from omniwalk.models.orpheus.config import VOICES
from omniwalk.models.orpheus.model import samples_received
from omniwalk.models.orpheus.speech import SpeechOutputProcessor
from processes import serve_process

SPEECH = "/v1/audio/speech"
TEXT = "The river ran past the old mill."


@pytest.fixture(scope="module")
def tts(tts_server):
    return tts_server


@pytest.fixture(scope="module")
def http(tts):
    with httpx.Client(base_url=tts.url, timeout=60) as client:
        yield client


def body(n: int, seed: int = 5, **fields) -> dict:
    return {"model": "tiny-orpheus", "input": TEXT, "voice": "tara", "max_output_tokens": n, "ignore_eos": True,
            "seed": seed, "temperature": 1.0, **fields}


def expected_samples(tts, n: int) -> int:
    """The documented count: complete frames F = n // 7 (ignore_eos: n codes), F * S samples."""
    return samples_received(n // 7, tts.engine.frontend(Capability.SPEECH).frame_samples)


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.split("\n") if line.startswith("data: ")]


def stream_pieces(http: httpx.Client, path: str, payload: dict) -> tuple[httpx.Response, list[bytes]]:
    with http.stream("POST", path, json=payload) as response:
        pieces = [piece for piece in response.iter_bytes() if piece]
    return response, pieces


# ---------------------------------------------------------------- the budget: every form carries the same bytes


@pytest.mark.parametrize("n", [1, 7, 8, pytest.param(28, marks=pytest.mark.slow), 29,
                               pytest.param(200, marks=pytest.mark.slow)])
def test_streamed_equals_non_streamed(tts, http, n):
    samples = expected_samples(tts, n)
    whole = http.post(SPEECH, json=body(n, response_format="pcm"))
    assert whole.status_code == 200 and whole.headers["content-type"] == "audio/pcm"
    pcm = whole.content
    assert len(pcm) == 2 * samples
    headers = whole.headers
    assert (headers["x-finish-reason"], headers["x-sample-rate"]) == ("length", "24000")
    assert [int(headers[f"x-usage-{k}"]) for k in ("output-tokens", "codes", "frames", "samples")] == \
        [n, n, n // 7, samples]

    # chunked PCM, as it is generated
    response, pieces = stream_pieces(http, SPEECH, body(n, response_format="pcm", stream=True))
    assert response.status_code == 200 and response.headers.get("transfer-encoding") == "chunked"
    assert b"".join(pieces) == pcm

    # SSE: base64 PCM deltas, then the usage
    events = sse_events(http.post(SPEECH, json=body(n, stream_format="sse")).text)
    deltas, done = events[:-1], events[-1]
    assert all(e["type"] == "speech.audio.delta" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == pcm
    assert done["type"] == "speech.audio.done" and done["finish_reason"] == "length"
    assert {k: done["usage"][k] for k in ("output_tokens", "codes", "frames", "samples")} == \
        {"output_tokens": n, "codes": n, "frames": n // 7, "samples": samples}
    if n == 200:   # streaming, not one burst at the end
        assert len(deltas) > 1

    # /generate: NDJSON lines with base64 chunks, and the non-streamed answer
    native = {k: v for k, v in body(n).items() if k not in ("model", "input")} | {"prompt": TEXT}
    lines = [json.loads(line) for line in http.post("/generate", json=native | {"stream": True}).text.splitlines()]
    assert b"".join(base64.b64decode(line["audio"]) for line in lines) == pcm
    assert sum(len(line["token_ids"]) for line in lines) == n
    last = lines[-1]
    assert last["finish_reason"] == "length" and last["sampling_rate"] == 24000
    assert last["usage"] == {"prompt_tokens": last["usage"]["prompt_tokens"], "output_tokens": n, "codes": n,
                             "frames": n // 7, "samples": samples}
    answer = http.post("/generate", json=native).json()
    assert base64.b64decode(answer["audio"]) == pcm and answer["usage"] == last["usage"]
    assert answer["token_ids"] == [t for line in lines for t in line["token_ids"]]


def wav_sizes(data: bytes) -> tuple[int, int]:
    """(RIFF size, data size) of a canonical 44-byte-header WAV."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[36:40] == b"data"
    return struct.unpack("<I", data[4:8])[0], struct.unpack("<I", data[40:44])[0]


@pytest.mark.parametrize("n", [1, 29, pytest.param(200, marks=pytest.mark.slow)])
def test_wav_and_flac(tts, http, n):
    samples = expected_samples(tts, n)
    pcm = http.post(SPEECH, json=body(n, response_format="pcm")).content

    wav = http.post(SPEECH, json=body(n))    # wav is the default
    assert wav.headers["content-type"] == "audio/wav"
    riff, data = wav_sizes(wav.content)
    assert data == len(wav.content) - 44 == len(pcm) and riff == 36 + data
    audio, rate = soundfile.read(io.BytesIO(wav.content), dtype="int16")
    info = soundfile.info(io.BytesIO(wav.content))
    assert (rate, info.channels, info.subtype, info.frames) == (24000, 1, "PCM_16", samples)
    assert audio.tobytes() == pcm

    # streamed: the max-size header, then the same PCM
    _, pieces = stream_pieces(http, SPEECH, body(n, stream=True))
    streamed = b"".join(pieces)
    assert wav_sizes(streamed) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert streamed[:40] == wav.content[:4] + streamed[4:8] + wav.content[8:40]   # same format fields
    assert streamed[44:] == pcm
    audio, _ = soundfile.read(io.BytesIO(streamed), dtype="int16")   # libsndfile reads to the end
    assert audio.tobytes() == pcm

    flac = http.post(SPEECH, json=body(n, response_format="flac"))   # lossless: the same samples
    assert flac.headers["content-type"] == "audio/flac" and flac.content[:4] == b"fLaC"
    if n < 7:    # no frames: only the STREAMINFO block, which libsndfile cannot open
        assert len(flac.content) == 4 + 4 + 34
    else:
        audio, rate = soundfile.read(io.BytesIO(flac.content), dtype="int16")
        assert rate == 24000 and audio.tobytes() == pcm


# ---------------------------------------------------------------- the official openai client


def test_openai_client(tts):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=tts.url + "/v1", api_key="unused", max_retries=0)
    extra = {"max_output_tokens": 64, "ignore_eos": True, "seed": 9}
    pcm = client.audio.speech.create(model="tiny-orpheus", input=TEXT, voice="leo", response_format="pcm",
                                     extra_body=extra).content
    assert len(pcm) == 2 * expected_samples(tts, 64)
    with client.audio.speech.with_streaming_response.create(
            model="tiny-orpheus", input=TEXT, voice="leo", response_format="pcm",
            extra_body={**extra, "stream": True}) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert b"".join(response.iter_bytes()) == pcm
    wav = client.audio.speech.create(model="tiny-orpheus", input=TEXT, voice="leo", extra_body=extra).content
    assert soundfile.read(io.BytesIO(wav), dtype="int16")[0].tobytes() == pcm
    with pytest.raises(openai.BadRequestError, match="voice"):
        client.audio.speech.create(model="tiny-orpheus", input=TEXT, voice="alloy")


# ---------------------------------------------------------------- the SDK


def test_sdk_tts(tts):
    with Client(tts.url) as client:
        pcm = client.tts(TEXT, voice="zoe", response_format="pcm", max_output_tokens=50, ignore_eos=True, seed=2)
        assert len(pcm) == 2 * expected_samples(tts, 50)
        assert b"".join(client.tts_stream(TEXT, voice="zoe", max_output_tokens=50, ignore_eos=True, seed=2)) == pcm
        wav = client.tts(TEXT, voice="zoe", max_output_tokens=50, ignore_eos=True, seed=2)
        assert wav[:4] == b"RIFF" and wav[44:] == pcm
        with pytest.raises(ServerError) as error:
            client.tts(TEXT, voice="nobody")
        assert error.value.status == 400 and "tara" in error.value.message

    async def run():
        async with AsyncClient(tts.url) as client:
            whole = await client.tts(TEXT, voice="zoe", response_format="pcm", max_output_tokens=50,
                                     ignore_eos=True, seed=2)
            pieces = [p async for p in client.tts_stream(TEXT, voice="zoe", response_format="wav",
                                                         max_output_tokens=50, ignore_eos=True, seed=2)]
            return whole, b"".join(pieces)

    whole, streamed_wav = asyncio.run(run())
    assert whole == pcm and streamed_wav[44:] == pcm


# ---------------------------------------------------------------- many at once


@pytest.mark.slow
def test_32_concurrent_speech_requests(tts):
    budgets = [1 + (i * 13) % 90 for i in range(32)]
    kinds = ["pcm", "stream", "sse", "generate"]

    async def one(http: httpx.AsyncClient, i: int, n: int) -> tuple[int, int | None]:
        """(samples received, samples the usage reports; None where the response carries no usage)."""
        kind, payload = kinds[i % 4], body(n, seed=100 + i, response_format="pcm")
        if kind == "pcm":
            response = await http.post(SPEECH, json=payload)
            assert response.status_code == 200
            return len(response.content) // 2, int(response.headers["x-usage-samples"])
        if kind == "stream":
            async with http.stream("POST", SPEECH, json=payload | {"stream": True}) as response:
                return len(b"".join([p async for p in response.aiter_bytes()])) // 2, None
        if kind == "sse":
            events = sse_events((await http.post(SPEECH, json=payload | {"stream_format": "sse"})).text)
            assert events[-1]["type"] == "speech.audio.done"
            audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
            return len(audio) // 2, events[-1]["usage"]["samples"]
        native = {k: v for k, v in payload.items() if k not in ("model", "input", "response_format")}
        answer = (await http.post("/generate", json=native | {"prompt": TEXT})).json()
        assert len(answer["token_ids"]) == n and answer["finish_reason"] == "length"
        return len(base64.b64decode(answer["audio"])) // 2, answer["usage"]["samples"]

    async def crowd():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=tts.url, timeout=60, limits=limits) as http:
            return await asyncio.gather(*(one(http, i, n) for i, n in enumerate(budgets)))

    results = asyncio.run(crowd())
    for n, (received, reported) in zip(budgets, results):
        assert received == expected_samples(tts, n) and reported in (None, received)
    tts.wait_idle()


# ---------------------------------------------------------------- bad input


BAD = [
    # (name, path, body, status, a word the message must contain)
    ("unknown voice", SPEECH, {"input": TEXT, "voice": "alloy"}, 400, "tara"),
    ("mp3", SPEECH, {"input": TEXT, "response_format": "mp3"}, 400, "flac"),
    ("speed", SPEECH, {"input": TEXT, "speed": 1.5}, 400, "speed"),
    ("unknown field", SPEECH, {"input": TEXT, "temprature": 0.5}, 400, "temprature"),
    ("missing input", SPEECH, {"voice": "tara"}, 400, "input"),
    ("empty input", SPEECH, {"input": "  "}, 400, "empty"),
    ("wrong type", SPEECH, {"input": TEXT, "max_output_tokens": "5"}, 400, "max_output_tokens"),
    ("zero budget", SPEECH, {"input": TEXT, "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("beyond context", SPEECH, {"input": TEXT, "max_output_tokens": 10**6}, 400, "context"),
    ("negative temperature", SPEECH, {"input": TEXT, "temperature": -1.0}, 400, "temperature"),
    ("stream flac", SPEECH, {"input": TEXT, "response_format": "flac", "stream": True}, 400, "stream"),
    ("sse wav", SPEECH, {"input": TEXT, "response_format": "wav", "stream_format": "sse"}, 400, "pcm"),
    ("bad stream_format", SPEECH, {"input": TEXT, "stream_format": "ogg"}, 400, "stream_format"),
    ("instructions", SPEECH, {"input": TEXT, "instructions": "whisper"}, 400, "instructions"),
    ("unknown model", SPEECH, {"input": TEXT, "model": "tts-1"}, 404, "tts-1"),
    ("generate unknown field", "/generate", {"prompt": TEXT, "prompt_token_ids": [1]}, 422, "prompt_token_ids"),
    ("generate bad voice", "/generate", {"prompt": TEXT, "voice": "nobody"}, 400, "voice"),
    ("text route", "/v1/completions", {"prompt": "Hi"}, 400, "speech"),
]


@pytest.mark.parametrize("name,path,payload,status,word", BAD, ids=[case[0] for case in BAD])
def test_bad_input(http, name, path, payload, status, word):
    response = http.post(path, json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and word in error["message"], error


def test_voices_and_voice_object(tts, http):
    message = http.post(SPEECH, json={"input": TEXT, "voice": "alloy"}).json()["error"]["message"]
    assert all(voice in message for voice in VOICES)
    answer = http.post(SPEECH, json=body(14, voice={"id": "mia"}, response_format="pcm"))
    assert answer.status_code == 200 and len(answer.content) == 2 * expected_samples(tts, 14)


def test_text_model_has_no_speech(server):
    response = httpx.post(server.url + SPEECH, json={"model": "tiny-qwen3", "input": TEXT, "voice": "tara"})
    assert response.status_code == 400
    assert "does not produce speech" in response.json()["error"]["message"]


# ---------------------------------------------------------------- disconnects and failures


def test_disconnects_abort(tts, http):
    aborts = tts.metric("omniwalk_requests_total", {"outcome": "abort"})
    with pytest.raises(httpx.ReadTimeout):     # non-streamed: the client gives up
        httpx.post(tts.url + SPEECH, json=body(3000), timeout=0.5)
    with http.stream("POST", SPEECH, json=body(3000, stream_format="sse")) as response:
        for line in response.iter_lines():     # streamed: leave after the first audio
            if line.startswith("data: "):
                break
    tts.wait_idle(timeout=20)
    assert tts.metric("omniwalk_requests_total", {"outcome": "abort"}) - aborts == 2


def test_failure_after_the_stream_started(tts, http, monkeypatch):
    """Output processing that raises ends the request: an SSE error event; a broken-off
    chunked body for streamed audio (never a short file that looks whole); a 500 otherwise."""
    original = SpeechOutputProcessor.process

    def failing(self, out):
        if self.num_samples:
            raise RuntimeError("processing failed")
        return original(self, out)

    monkeypatch.setattr(SpeechOutputProcessor, "process", failing)
    events = sse_events(http.post(SPEECH, json=body(200, stream_format="sse")).text)
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and "processing failed" in events[-1]["error"]["message"]
    with pytest.raises(httpx.RemoteProtocolError):
        stream_pieces(http, SPEECH, body(200, response_format="pcm", stream=True))
    with Client(tts.url) as client, pytest.raises(ServerError, match="broken off"):
        list(client.tts_stream(TEXT, max_output_tokens=200, ignore_eos=True))
    response = http.post(SPEECH, json=body(200))
    assert response.status_code == 500 and "processing failed" in response.json()["error"]["message"]
    monkeypatch.undo()
    tts.wait_idle(timeout=20)


# ---------------------------------------------------------------- omniwalk serve tiny-orpheus


def test_cli_codec_flag():
    from omniwalk.cli import _engine_args, build_parser

    args = build_parser().parse_args(["serve", "/ckpt/orpheus", "--codec", "/ckpt/snac_24khz"])
    assert _engine_args(args).codec == "/ckpt/snac_24khz" and _engine_args(args).model == "/ckpt/orpheus"
    assert _engine_args(build_parser().parse_args(["serve", "tiny-orpheus"])).codec is None


@pytest.mark.slow
def test_serve_tiny_orpheus_process():
    with serve_process("tiny-orpheus", "--kv-cache-tokens", "2048", "--max-num-seqs", "4") as (url, output):
        with Client(url) as client:
            wav = client.tts(TEXT, max_output_tokens=21, ignore_eos=True)
    assert soundfile.info(io.BytesIO(wav)).frames == samples_received(3, 64)
    assert "serving 'tiny-orpheus'" in output[0] and "KV cache 2048 tokens" in output[0], output[0]


def test_speech_after_shutdown_is_refused():
    """Not enqueued where nothing would ever answer it."""
    from omniwalk.api import Engine
    from omniwalk.capabilities.speech import SpeechRequest

    engine = Engine(EngineArgs("tiny-orpheus", kv_cache_tokens=256))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(SpeechRequest(TEXT, max_output_tokens=7))


def test_audio_slo_metrics(tts, http):
    """Time to first audio, seconds of audio out and the real-time factor, per request (issue 26)."""
    names = ("omniwalk_time_to_first_audio_seconds_count", "omniwalk_audio_real_time_factor_count",
             "omniwalk_audio_output_seconds_total")
    before = {name: tts.metric(name, {"model_name": "tiny-orpheus"}) for name in names}
    n = 70
    assert http.post(SPEECH, json=body(n, response_format="pcm")).status_code == 200
    after = {name: tts.metric(name, {"model_name": "tiny-orpheus"}) for name in names}
    rate = tts.engine.frontend(Capability.SPEECH).sampling_rate
    assert after[names[0]] == before[names[0]] + 1 and after[names[1]] == before[names[1]] + 1
    assert after[names[2]] - before[names[2]] == pytest.approx(expected_samples(tts, n) / rate)
