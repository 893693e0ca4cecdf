"""tiny-qwen3-omni over real HTTP: chat with image and audio parts through the official
`openai` client, streamed == non-streamed, budgets exact, a corrupt part is a 400 that
names it and leaves the others alone, and a disconnect gives every page back."""

from __future__ import annotations

import base64
import json
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile
from openai import OpenAI
from PIL import Image

from omniwalk.loading import EngineArgs

MODEL = "tiny-qwen3-omni"


def png(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_b64(seed: int, seconds: float = 1.5) -> str:
    t = np.arange(int(16000 * seconds)) / 16000
    samples = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


def content(seed: int) -> list[dict]:
    return [{"type": "text", "text": "Describe"},
            {"type": "image_url", "image_url": {"url": png(seed)}},
            {"type": "text", "text": "and"},
            {"type": "input_audio", "input_audio": {"data": wav_b64(seed), "format": "wav"}}]


@pytest.fixture(scope="module")
def server(launch_server):
    with launch_server(EngineArgs(MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_chat_with_image_and_audio_streamed_equals_not(client, max_tokens):
    messages = [{"role": "user", "content": content(1)}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    assert whole.usage.completion_tokens == max_tokens
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,
                                                 temperature=0, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == max_tokens
    # the prompt counts every placeholder token the media expanded into
    assert whole.usage.prompt_tokens > 20


def test_the_same_media_give_the_same_answer(client):
    def ask(seed):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content(seed)}],
                                              max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    first, again = ask(1), ask(1)
    assert first.choices[0].message.content == again.choices[0].message.content


def test_a_corrupt_image_is_a_400_naming_it_and_others_finish(server):
    bad = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                               + base64.b64encode(b"garbage").decode()}}]

    def post(body):
        with httpx.Client(base_url=server.url, timeout=60) as http:
            return http.post("/v1/chat/completions", json=body)

    good = {"model": MODEL, "messages": [{"role": "user", "content": content(2)}], "max_tokens": 3,
            "ignore_eos": True}
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(post, good) for _ in range(8)]
        refused = pool.submit(post, {"model": MODEL, "messages": [{"role": "user", "content": bad}],
                                     "max_tokens": 3}).result()
        answers = [f.result() for f in futures]
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages[0].content[1]"
    assert all(a.status_code == 200 and a.json()["usage"]["completion_tokens"] == 3 for a in answers)
    server.wait_idle()


def test_disconnect_mid_stream_frees_pages(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content(3)}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break   # one chunk, then hang up
    server.wait_idle()


# ----------------------------------------------------------------------------- spoken answers

SAMPLES_PER_FRAME, LOOKAHEAD = 96, 32   # tiny-qwen3-omni's Code2Wav: F frames give F * 96 - 32 samples


def spoken(client, frames: int, stream: bool = False, **audio):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something"}], max_tokens=3, temperature=0, seed=7,
        modalities=["text", "audio"], audio={"voice": "Ethan", "format": "pcm16" if stream else "wav", **audio},
        stream=stream, extra_body={"ignore_eos": True, "audio": {"voice": audio.get("voice", "Ethan"),
                                                                  "format": "pcm16" if stream else "wav",
                                                                  "max_frames": frames}})


@pytest.mark.parametrize("frames", [1, 4, 40])   # 40: a short first chunk, then 16-frame ones
def test_spoken_answer_streamed_equals_not(client, frames):
    whole = spoken(client, frames)
    audio = whole.choices[0].message.audio
    wav = base64.b64decode(audio.data)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000 and len(samples) == frames * SAMPLES_PER_FRAME - LOOKAHEAD and np.abs(samples).max() > 0
    assert whole.choices[0].message.content is None and audio.transcript
    details = whole.usage.completion_tokens_details
    assert (details.text_tokens, details.audio_tokens) == (3, frames) and whole.usage.completion_tokens == 3 + frames
    pcm, transcript = b"", ""
    for event in spoken(client, frames, stream=True):
        for choice in event.choices:
            delta = choice.delta.audio   # the openai client's typed delta (ChoiceDeltaAudio)
            if delta is not None:
                pcm += base64.b64decode(delta.data or "")
                transcript += delta.transcript or ""
    assert pcm == samples.tobytes() and transcript == audio.transcript


@pytest.mark.parametrize("transcript", ["", 'a "data": "" b \\', "\u00fc \u2028 \x00"])
@pytest.mark.parametrize("size", [0, 1, 2, 3, 3072, 61440])
def test_audio_event_is_what_json_dumps_writes(transcript, size):
    """The streamed audio delta's base64 is spliced into the event: the same bytes as
    json.dumps of the payload with it, whatever the transcript holds."""
    from omniwalk.server.openai_api import _sse, _sse_with_audio

    pcm = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()

    def payload(data: str) -> dict:
        return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"audio": {
            "id": "audio_chatcmpl-1_0", "transcript": transcript, "data": data, "expires_at": 1}}, "finish_reason": None}],
            "usage": None}

    expected = _sse(payload(base64.b64encode(pcm).decode())).encode()
    assert _sse_with_audio(payload(""), base64.b64encode(pcm)) == expected


def test_spoken_answers_feed_the_audio_metrics(server, client):
    names = ("omniwalk_time_to_first_audio_seconds_count", "omniwalk_audio_real_time_factor_count",
             "omniwalk_audio_output_seconds_total")
    before = {name: server.metric(name) for name in names}
    frames = 4
    spoken(client, frames)                         # one whole, one streamed
    list(spoken(client, frames, stream=True))
    after = {name: server.metric(name) for name in names}
    assert after[names[0]] == before[names[0]] + 2 and after[names[1]] == before[names[1]] + 2
    assert after[names[2]] - before[names[2]] == pytest.approx(2 * (frames * SAMPLES_PER_FRAME - LOOKAHEAD) / 24000)


def test_stats_line_reports_the_audio_rate(server, client):
    from omniwalk.server.stats_log import StatsLogger

    logger = StatsLogger(server.engine, server.app.state.ctx.metrics, clock=iter([0.0, 0.01, 0.02]).__next__)
    list(spoken(client, 25, stream=True))   # 25 * 96 - 32 samples: 0.0987 s of 24 kHz audio in a 0.01 s interval
    server.wait_idle()
    assert "tokens/s, Avg audio throughput: 9.9 audio s/s, Running: 0 reqs" in logger.tick()
    assert "Avg audio throughput: 0.0 audio s/s" in logger.tick()   # the interval it went idle


@pytest.mark.parametrize("body, param", [
    ({"modalities": ["text", "audio"]}, "audio"),
    ({"modalities": ["audio"], "audio": {"voice": "ethan"}}, "modalities"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "nobody"}}, "audio.voice"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "mp3"}}, "audio.format"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "stream": True}, "audio.format"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "ethan", "max_frames": 0}}, "audio.max_frames"),
])
def test_bad_spoken_requests_are_400s(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_generate_speaks(server, client):
    body = {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "max_output_tokens": 3,
            "ignore_eos": True, "seed": 7, "speech": {"voice": "AIDEN", "max_frames": 5}}
    whole = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    pcm = base64.b64decode(whole["audio"])
    assert whole["sample_rate"] == 24000 and len(pcm) == 2 * (5 * SAMPLES_PER_FRAME - LOOKAHEAD)
    assert whole["usage"] == {"prompt_tokens": whole["usage"]["prompt_tokens"], "output_tokens": 3, "audio_frames": 5}
    lines = [json.loads(line) for line in httpx.post(server.url + "/generate", json={**body, "stream": True},
                                                      timeout=60).text.splitlines()]
    assert b"".join(base64.b64decode(line["audio"]) for line in lines) == pcm
    assert sum((line["token_ids"] for line in lines), []) == whole["token_ids"]


def test_audio_speech_route_says_where_the_audio_is(server):
    response = httpx.post(server.url + "/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": "ethan"})
    assert response.status_code == 400 and "chat/completions" in response.json()["error"]["message"]


def test_spoken_answer_about_an_image_and_audio(client):
    """Speaking about media in the prompt: a 200 with audio, streamed == not."""
    frames = 3
    common = dict(model=MODEL, messages=[{"role": "user", "content": content(2)}], max_tokens=3, temperature=0,
                  seed=7, modalities=["text", "audio"])
    whole = client.chat.completions.create(
        **common, audio={"voice": "Ethan", "format": "wav"},
        extra_body={"ignore_eos": True, "audio": {"voice": "Ethan", "format": "wav", "max_frames": frames}})
    audio = whole.choices[0].message.audio
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)), dtype="int16")
    assert rate == 24000 and len(samples) == frames * SAMPLES_PER_FRAME - LOOKAHEAD and np.abs(samples).max() > 0
    assert audio.transcript and whole.usage.completion_tokens_details.audio_tokens == frames
    assert whole.usage.prompt_tokens > 20   # the image's and the clip's placeholders
    pcm = b"".join(base64.b64decode(choice.delta.audio.data or "")
                   for event in client.chat.completions.create(
                       **common, audio={"voice": "Ethan", "format": "pcm16"}, stream=True,
                       extra_body={"ignore_eos": True, "audio": {"voice": "Ethan", "format": "pcm16",
                                                                 "max_frames": frames}})
                   for choice in event.choices if choice.delta.audio is not None)
    assert pcm == samples.tobytes()
