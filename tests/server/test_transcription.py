"""Speech recognition over loopback HTTP on tiny-whisper: POST /v1/audio/transcriptions with
the official openai client (json, text, verbose_json with timestamp segments, SSE), srt and
vtt cues per segment, /v1/audio/translations, WAV/FLAC/MP3 uploads, the SDK, the budget
(exactly N tokens), 8 concurrent requests, bad input, disconnects, and the 400 of a model
that does not transcribe.

tiny-whisper has random weights: without timestamps it never says EOS on these clips, so a
window runs to its decoder context (444 tokens) and N below that gives exactly N tokens.
Its greedy transcript without timestamps is one special token repeated (no text): where a
test needs text it samples (SAMPLED: temperature 1, seeded)."""

from __future__ import annotations

import asyncio
import io
import json
import re
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
import soundfile
from probes import cross_attention_slots
from running import TEST_LIMITS, RunningServer

from omniwalk.client import AsyncClient, Client, ServerError
from omniwalk.capabilities.transcription import TranscriptionRequest, TranscriptSegment, transcribe
from omniwalk.server.transcription import TranscriptionForm, _timestamp, srt, vtt

LANGUAGES = pytest.importorskip("transformers.models.whisper.tokenization_whisper").LANGUAGES

ROUTE = "/v1/audio/transcriptions"
TRANSLATE = "/v1/audio/translations"
TIMESTAMP_BEGIN = 512      # <|0.00|> of tiny-whisper's vocabulary
SR = 16000


def clip(seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(SR * seconds)) / SR
    chirp = 0.4 * np.sin(2 * np.pi * (200 + 300 * t / seconds + 40 * seed) * t)
    return (chirp + 0.05 * np.random.default_rng(seed).standard_normal(t.size)).astype(np.float32)


def encode(samples: np.ndarray, fmt: str = "WAV", rate: int = SR) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt)
    return buffer.getvalue()


WAV = encode(clip(5))
LONG = encode(clip(31, seed=1))       # two windows: 30 s and 1 s
LONG_N = 460                          # window 0's 444 tokens, then 16 of window 1
SAMPLED = {"temperature": 1.0, "seed": 7}
SEGMENTS = ("segment",)


def sse_events(text: str) -> list:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def whisper(whisper_server):
    return whisper_server


@pytest.fixture(scope="module")
def http(whisper):
    with httpx.Client(base_url=whisper.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(whisper):
    return openai.OpenAI(base_url=whisper.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def long_reference(whisper):
    return transcribe(whisper.engine, TranscriptionRequest(LONG, max_output_tokens=LONG_N, **SAMPLED))


def post(http: httpx.Client, audio: bytes = WAV, **fields) -> httpx.Response:
    data = {name: str(value).lower() if isinstance(value, bool) else str(value) for name, value in fields.items()}
    return http.post(ROUTE, files={"file": ("clip", audio)}, data=data)


# ---------------------------------------------------------------- the official client


@pytest.mark.slow
def test_openai_client_json_text_verbose_equal_in_process(whisper, oai):
    reference = transcribe(whisper.engine, TranscriptionRequest(WAV, max_output_tokens=24, **SAMPLED))
    assert reference.text and reference.finish_reason == "length"
    extra = {"max_output_tokens": 24, "seed": SAMPLED["seed"]}
    options = dict(model="tiny-whisper", file=("clip.wav", WAV), temperature=1.0, extra_body=extra)
    result = oai.audio.transcriptions.create(**options)
    assert result.text == reference.text
    assert (result.usage.type, result.usage.output_tokens, result.usage.input_tokens) == ("tokens", 24, 1500)
    assert result.usage.finish_reason == "length" and result.usage.seconds == 5.0
    assert oai.audio.transcriptions.create(**options, response_format="text") == reference.text
    # verbose_json decodes timestamps: the model's segments, the detected language by name
    timed = transcribe(whisper.engine, TranscriptionRequest(WAV, max_output_tokens=24, timestamp_granularities=SEGMENTS,
                                                            **SAMPLED))
    verbose = oai.audio.transcriptions.create(**options, response_format="verbose_json",
                                              timestamp_granularities=["word", "segment"])
    assert (verbose.text, verbose.language, verbose.duration) == (timed.text, timed.language_name, 5.0)
    assert verbose.language in LANGUAGES.values() and verbose.task == "transcribe"
    assert [(s.id, s.seek, s.start, s.end, s.text, s.tokens) for s in verbose.segments] == [
        (i, s.seek, s.start, s.end, s.text, s.token_ids) for i, s in enumerate(timed.segments)]
    assert len(timed.segments) > 1 and timed.segments[0].token_ids[0] >= TIMESTAMP_BEGIN
    worded = transcribe(whisper.engine, TranscriptionRequest(WAV, max_output_tokens=24, **SAMPLED,
                                                             timestamp_granularities=("segment", "word")))
    assert [(w.word, w.start, w.end) for w in verbose.words] == [(w.word, w.start, w.end) for w in worded.words]
    assert verbose.words and [(s.start, s.end, s.token_ids) for s in worded.segments] == [
        (s.start, s.end, s.token_ids) for s in timed.segments]      # aligning changes no sample
    given = oai.audio.transcriptions.create(**options, response_format="verbose_json", language="de")
    assert given.language == "german"
    # the client's defaults: no budget, the whole window's context
    full = oai.audio.transcriptions.create(model="tiny-whisper", file=("clip.wav", WAV), language="en")
    assert full.text == transcribe(whisper.engine, TranscriptionRequest(WAV, language="en")).text


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")   # the openai client marks translations so
def test_openai_client_translations(whisper, oai, http):
    """/v1/audio/translations: task translate, the transcription fields but language and stream."""
    reference = transcribe(whisper.engine, TranscriptionRequest(WAV, task="translate", max_output_tokens=24,
                                                                **SAMPLED))
    options = dict(model="tiny-whisper", file=("clip.wav", WAV), temperature=1.0,
                   extra_body={"max_output_tokens": 24, "seed": SAMPLED["seed"]})
    assert oai.audio.translations.create(**options).text == reference.text
    raw = http.post(TRANSLATE, files={"file": ("clip", WAV)}, data={"max_output_tokens": "2"})
    assert raw.status_code == 200 and raw.headers["x-request-id"].startswith("trsl-")
    verbose = oai.audio.translations.create(**options, response_format="verbose_json")
    timed = transcribe(whisper.engine, TranscriptionRequest(WAV, task="translate", max_output_tokens=24,
                                                            timestamp_granularities=SEGMENTS, **SAMPLED))
    assert (verbose.text, verbose.language, verbose.task) == (timed.text, "english", "translate")
    assert [s.tokens for s in verbose.segments] == [s.token_ids for s in timed.segments]
    with Client(whisper.url) as client:
        assert client.translate(WAV, response_format="text", max_output_tokens=24, **SAMPLED) == reference.text
    answer = http.post(TRANSLATE, files={"file": ("clip", WAV)}, data={"language": "de"})
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "language")


def test_temperature_fallback_extension(whisper, http):
    """temperature_fallback=true: openai-whisper's schedule from `temperature` (the engine's
    fallback itself: tests/models/test_whisper_timestamps.py)."""
    schedule = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert TranscriptionForm(b"", temperature_fallback=True).temperatures == schedule
    assert TranscriptionForm(b"", temperature=0.5, temperature_fallback=True).temperatures == (0.5, 0.7, 0.9)
    assert TranscriptionForm(b"", temperature=0.5).temperatures == 0.5
    answer = post(http, max_output_tokens=40, response_format="verbose_json", temperature_fallback=True, seed=5)
    reference = transcribe(whisper.engine, TranscriptionRequest(WAV, max_output_tokens=40, temperature=schedule,
                                                                seed=5, timestamp_granularities=SEGMENTS))
    body = answer.json()
    assert body["text"] == reference.text and body["usage"]["output_tokens"] == 40
    assert [(s["temperature"], s["tokens"]) for s in body["segments"]] == [(s.temperature, s.token_ids)
                                                                           for s in reference.segments]


def test_streamed_deltas_join_to_non_streamed(whisper, oai, http, long_reference):
    events = list(oai.audio.transcriptions.create(model="tiny-whisper", file=("long.wav", LONG), stream=True,
                                                  temperature=1.0,
                                                  extra_body={"max_output_tokens": LONG_N, "seed": SAMPLED["seed"]}))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert done.type == "transcript.text.done" and len(deltas) > 1
    assert "".join(deltas) == done.text == long_reference.text
    assert done.usage.output_tokens == LONG_N and done.usage.finish_reason == "length"
    assert post(http, LONG, max_output_tokens=LONG_N, **SAMPLED).json()["text"] == long_reference.text
    raw = post(http, LONG, max_output_tokens=5, stream=True, response_format="text")
    assert raw.headers["content-type"].startswith("text/event-stream") and sse_events(raw.text)[-1] == "[DONE]"


# ---------------------------------------------------------------- formats


SRT_CUE = re.compile(r"(\d+)\n(\d\d:\d\d:\d\d,\d\d\d) --> (\d\d:\d\d:\d\d,\d\d\d)\n((?:[^\n]+\n)+)")
VTT_CUE = re.compile(r"(\d\d:\d\d:\d\d\.\d\d\d) --> (\d\d:\d\d:\d\d\.\d\d\d)\n((?:[^\n]+\n)+)")


def test_srt_and_vtt_cues_are_the_segments(whisper, http):
    """srt and vtt decode timestamps: a cue per segment of the model's, at its times."""
    reference = transcribe(whisper.engine, TranscriptionRequest(WAV, max_output_tokens=60,
                                                                timestamp_granularities=SEGMENTS))
    segments = [s for s in reference.segments if s.text]
    assert len(segments) > 2
    answer = post(http, max_output_tokens=60, response_format="srt")
    assert answer.status_code == 200 and answer.headers["x-finish-reason"] == "length"
    blocks = answer.text.split("\n\n")
    assert blocks[-1] == "" and len(blocks) == len(segments) + 1
    cues = [SRT_CUE.fullmatch(block + "\n") for block in blocks[:-1]]
    assert all(cues), answer.text
    assert [c.group(1, 2, 3) for c in cues] == [(str(n), _timestamp(s.start, ","), _timestamp(s.end, ","))
                                                for n, s in enumerate(segments, start=1)]
    answer = post(http, max_output_tokens=60, response_format="vtt")
    assert answer.headers["content-type"].startswith("text/vtt") and answer.text.startswith("WEBVTT\n\n")
    blocks = answer.text[len("WEBVTT\n\n"):].split("\n\n")
    cues = [VTT_CUE.fullmatch(block + "\n") for block in blocks[:-1]]
    assert all(cues) and [c.group(1, 2) for c in cues] == [(_timestamp(s.start, "."), _timestamp(s.end, "."))
                                                           for s in segments]


def test_cue_text_is_made_safe():
    segments = [TranscriptSegment(0, 0.0, 30.0, "a <b> & c\n\n  --> d ", [1]),
                TranscriptSegment(1, 30.0, 61.5, " \n", [2]),                  # no text: no cue
                TranscriptSegment(2, 3600.0, 3601.25, "end", [3])]
    assert srt(segments) == ("1\n00:00:00,000 --> 00:00:30,000\na <b> & c\n-> d\n\n"
                             "2\n01:00:00,000 --> 01:00:01,250\nend\n\n")
    assert vtt(segments) == ("WEBVTT\n\n00:00:00.000 --> 00:00:30.000\na &lt;b&gt; &amp; c\n--&gt; d\n\n"
                             "01:00:00.000 --> 01:00:01.250\nend\n\n")


def test_wav_flac_and_mp3_uploads(whisper, http, tmp_path):
    samples = clip(4, seed=2)
    texts = [post(http, encode(samples, fmt), max_output_tokens=12, **SAMPLED).json()["text"]
             for fmt in ("WAV", "FLAC")]
    reference = transcribe(whisper.engine, TranscriptionRequest(samples, max_output_tokens=12, **SAMPLED))
    assert texts[0] == texts[1] == reference.text and texts[0]
    mp3 = post(http, encode(samples, "MP3"), max_output_tokens=3, response_format="verbose_json")
    assert mp3.status_code == 200 and abs(mp3.json()["duration"] - 4.0) < 0.1
    # the SDK: bytes or a path; json gives a dict, text a str
    path = tmp_path / "clip.flac"
    path.write_bytes(encode(samples, "FLAC"))
    with Client(whisper.url) as client:
        assert client.transcribe(path, max_output_tokens=12, **SAMPLED)["text"] == texts[0]
        assert client.transcribe(encode(samples), response_format="text", max_output_tokens=12, **SAMPLED) == texts[0]
        with pytest.raises(ServerError) as error:
            client.transcribe(b"", max_output_tokens=12)
        assert error.value.status == 400 and "empty" in error.value.message

    async def sdk():
        async with AsyncClient(whisper.url) as client:
            return await client.transcribe(str(path), response_format="verbose_json", max_output_tokens=12,
                                           timestamp_granularities=["segment"], **SAMPLED)
    timed = transcribe(whisper.engine, TranscriptionRequest(samples, max_output_tokens=12,
                                                            timestamp_granularities=SEGMENTS, **SAMPLED))
    assert asyncio.run(sdk())["text"] == timed.text


# ---------------------------------------------------------------- the budget and batching


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_output_tokens_is_exact(http, n):
    answer = post(http, max_output_tokens=n, response_format="verbose_json")
    body = answer.json()
    assert body["usage"]["output_tokens"] == n and len(body["segments"][0]["tokens"]) == n
    assert (answer.headers["x-usage-output-tokens"], answer.headers["x-finish-reason"]) == (str(n), "length")


@pytest.mark.slow
def test_8_concurrent_transcriptions_equal_each_alone(whisper, http):
    audios = [encode(clip(2 + i, seed=i)) for i in range(8)]
    # tiny-whisper's greedy text hardly depends on the audio: half of them sample, seeded
    fields = [{"max_output_tokens": "16", **({"temperature": "1.0", "seed": str(i)} if i % 2 else {"language": "en"})}
              for i in range(8)]
    alone = [post(http, audio, **f).json()["text"] for audio, f in zip(audios, fields)]

    async def together():
        async with httpx.AsyncClient(base_url=whisper.url, timeout=60) as client:
            answers = await asyncio.gather(*[client.post(ROUTE, files={"file": ("clip", audio)}, data=f)
                                             for audio, f in zip(audios, fields)])
        return [a.json()["text"] for a in answers]
    assert asyncio.run(together()) == alone
    assert len(set(alone)) > 4


# ---------------------------------------------------------------- bad input, disconnects, other models


def test_bad_input_is_a_400_and_the_server_keeps_serving(whisper, http):
    cases = [
        ({"file": ("clip", b"")}, {}, "file", "empty"),
        ({"file": ("clip", b"\x00garbage bytes, not audio" * 10)}, {}, "file", "could not decode"),
        ({"file": ("clip", WAV)}, {"response_format": "xml"}, "response_format", "not supported"),
        ({"file": ("clip", WAV)}, {"response_format": "srt", "stream": "true"}, "response_format",
         "cannot be streamed"),
        ({"file": ("clip", WAV)}, {"colour": "blue"}, "colour", "Unrecognized request argument"),
        ({"file": ("clip", WAV)}, {"include[]": "logprobs"}, "include[]", "not supported"),
        ({"file": ("clip", WAV)}, {"temperature": "hot"}, "temperature", "number"),
        ({"file": ("clip", WAV)}, {"stream": "maybe"}, "stream", "true or false"),
        ({"file": ("clip", WAV)}, {"max_output_tokens": "0"}, "max_output_tokens", ">= 1"),
        ({"file": ("clip", WAV)}, {"max_output_tokens": "445"}, "max_output_tokens", "exceeds"),
        ({"file": ("clip", WAV)}, {"language": "klingon"}, "language", "unsupported language"),
        ({"file": ("clip", WAV)}, {"language": ["en", "de"]}, "language", "2 times"),
        ({"file": ("clip", WAV)}, {"timestamp_granularities[]": "character", "response_format": "verbose_json"},
         "timestamp_granularities[]", "not supported"),
        ({"file": ("clip", WAV)}, {"timestamp_granularities[]": "segment"}, "timestamp_granularities[]",
         "needs response_format verbose_json"),
        ({}, {"language": "en"}, "file", "multipart/form-data"),
        ({"prompt": (None, "hello")}, {}, "file", "`file` is required"),      # multipart, no file part
    ]
    for files, data, param, message in cases:
        answer = http.post(ROUTE, files=files or None, data=data)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"], error["param"]) == (400, 400, param), (data, error)
        assert message in error["message"], error
    assert http.post(ROUTE, json={"file": "x"}).status_code == 400
    wrong_model = post(http, model="whisper-1")
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["param"] == "model"
    assert http.post("/generate", json={"prompt": "hi"}).json()["error"]["message"] == \
        "model 'tiny-whisper' does not generate text"
    assert post(http, max_output_tokens=4).json()["usage"]["output_tokens"] == 4
    whisper.wait_idle()
    free, slots = whisper.engine.inspect(cross_attention_slots)
    assert free == slots


def test_client_disconnect_aborts(whisper, http):
    aborted = whisper.metric("omniwalk_requests_total", {"outcome": "abort"})
    with http.stream("POST", ROUTE, files={"file": ("long", LONG)}, data={"stream": "true"}) as response:
        first = next(response.iter_lines())
        assert json.loads(first[len("data: "):])["type"] == "transcript.text.delta"
    with pytest.raises(httpx.ReadTimeout):   # not streamed: the client gives up while it runs
        httpx.post(whisper.url + ROUTE, files={"file": ("long", LONG)}, timeout=0.3)
    whisper.wait_idle(timeout=5)
    assert whisper.metric("omniwalk_requests_total", {"outcome": "abort"}) == aborted + 2
    free, slots = whisper.engine.inspect(cross_attention_slots)
    assert free == slots


def test_a_text_model_does_not_transcribe(server):
    for route in (ROUTE, TRANSLATE):
        answer = httpx.post(server.url + route, files={"file": ("clip", WAV)}, data={"model": "tiny-qwen3"})
        assert answer.status_code == 400
        assert answer.json()["error"] == {"message": "model 'tiny-qwen3' does not transcribe speech",
                                          "type": "BadRequestError", "param": "model", "code": 400}


@pytest.mark.slow
def test_an_upload_over_max_upload_bytes_is_refused(whisper):
    """The file part's own cap (the body as a whole is cut off while it streams: test_hardening.py)."""
    longer = encode(clip(5.01))
    with RunningServer(whisper.engine, limits=replace(TEST_LIMITS, max_upload_bytes=len(WAV))) as running:
        answer = httpx.post(running.url + ROUTE, files={"file": ("clip.wav", longer)}, data={"model": "tiny-whisper"})
        assert answer.status_code == 413 and answer.json()["error"]["param"] == "file"
        assert f"at most {len(WAV)} are accepted" in answer.json()["error"]["message"]
        ok = httpx.post(running.url + ROUTE, files={"file": ("clip.wav", WAV)}, data={"model": "tiny-whisper",
                                                                                     "max_output_tokens": "2"})
        assert ok.status_code == 200


def test_audio_in_metrics(whisper, http):
    """Seconds of audio transcribed and each request's real-time factor (issue 26)."""
    labels = {"model_name": "tiny-whisper"}
    seconds = whisper.metric("omniwalk_audio_input_seconds_total", labels)
    rtf = whisper.metric("omniwalk_transcription_real_time_factor_count", labels)
    assert post(http, max_output_tokens=4).status_code == 200
    assert whisper.metric("omniwalk_audio_input_seconds_total", labels) == pytest.approx(seconds + 5.0)
    assert whisper.metric("omniwalk_transcription_real_time_factor_count", labels) == rtf + 1


def test_asr_bench_over_http(whisper, tmp_path):
    """`omniwalk bench --asr --url`: clips uploaded to the route, counts from its usage (issue 26)."""
    from omniwalk.cli import main

    out = tmp_path / "asr.json"
    assert main(["bench", "--asr", "--url", whisper.url, "--num-prompts", "2", "--max-concurrency", "2",
                 "--audio-seconds", "2", "--output-len", "4", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert (summary["num_completed"], summary["output_tokens"]) == (2, 8)
    # no TTFT over HTTP: it is the first text delta, and these greedy transcripts have no text
    assert summary["audio_seconds"] == pytest.approx(4.0)
