"""No request may stall, starve or balloon the server (issue 28), each check over loopback
HTTP: hostile audio headers on the transcription route, JSON bodies and uploads over their
limits (refused while they stream, the loop serving everyone else meanwhile), a huge
prompt, half-open and slow connections, the connection cap, cross-site requests and Host
names, `n`, 500 bodies, the default model id, and a bounded soak of good, bad and aborted
requests on text, speech and transcription.

One text engine serves this module; each check that needs other limits runs its own
uvicorn (`RunningServer`) over that engine, which costs no model load."""

from __future__ import annotations

import io
import json
import logging
import selectors
import socket
import subprocess
import sys
import threading
import time
import wave
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from probes import cross_attention_slots, kv_pages
from running import TEST_LIMITS, RunningServer, launch

from omniwalk.loading import EngineArgs
from omniwalk.server.connections import RateLimitedLoopErrors

# latencies under hostile load (a stream's gaps, /health, refusals in well under a second):
# run alone, not beside other tests on the same cores (the README's test command)
pytestmark = pytest.mark.timing

TRANSCRIBE = "/v1/audio/transcriptions"
COMPLETIONS = "/v1/completions"
MiB = 2**20


@pytest.fixture(scope="module")
def text():
    """tiny-qwen3 holding at most 8 requests (4 running, 4 waiting): `n` can fill it."""
    with launch(EngineArgs("tiny-qwen3", max_num_seqs=4, max_queue=4)) as running:
        yield running


@pytest.fixture(scope="module")
def strict(text):
    """The text engine behind short timeouts, an origin allow-list and a Host allow-list."""
    limits = replace(TEST_LIMITS, timeout_header_s=0.5, timeout_body_s=0.5, allowed_origins=("https://app.example",),
                     allowed_hosts=("127.0.0.1", "localhost"))
    with RunningServer(text.engine, limits=limits) as running:
        yield running


def wav(rate: int, frames: int, channels: int = 1) -> bytes:
    """A 16-bit WAV of silence claiming `rate` Hz, written by the standard library."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(b"\0" * (2 * channels * frames))
    return buffer.getvalue()


def rss_bytes() -> int:
    """This process's resident memory (the servers here run in it, their engines apart)."""
    with open("/proc/self/status") as status:
        kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kb * 1024


class Sampler:
    """Samples `measure()` every `interval_s` on a thread while the block runs."""

    def __init__(self, measure, interval_s: float = 0.005):
        self.measure, self.interval_s = measure, interval_s
        self.values: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.values.append(self.measure())
            time.sleep(self.interval_s)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


OUTSIDE = str(Path(__file__).with_name("outside_clients.py"))


class HealthProbe:
    """GET /health every 20 ms from another process while the block runs (outside_clients.py);
    `latencies` after the block."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []

    def __enter__(self) -> "HealthProbe":
        self.process = subprocess.Popen([sys.executable, OUTSIDE, "health", self.url], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"
        self._feeding = threading.Event()
        self._feeder = threading.Thread(target=self._feed, daemon=True)   # one line per probe: "go" until stopped
        self._feeder.start()
        time.sleep(0.1)
        return self

    def _feed(self) -> None:
        while not self._feeding.is_set():
            self.process.stdin.write("go\n")
            self.process.stdin.flush()
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self._feeding.set()
        self._feeder.join()
        out, _ = self.process.communicate("stop\n", timeout=30)
        self.latencies = json.loads(out.strip().splitlines()[-1])
        assert self.latencies

    @property
    def worst(self) -> float:
        return max(self.latencies)


class StreamGaps:
    """A long NDJSON stream read on a thread: the time between its lines while the block runs."""

    def __init__(self, url: str):
        self.url = url
        self.arrivals: list[float] = []
        self.started, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        body = {"prompt": "Hi", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/generate", json=body, timeout=30) as response:
            for _ in response.iter_lines():
                self.arrivals.append(time.perf_counter())
                self.started.set()
                if self.stop.is_set():
                    return

    def __enter__(self) -> "StreamGaps":
        self.thread.start()
        assert self.started.wait(30)
        time.sleep(0.2)
        self.window = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.window_end = time.perf_counter()
        self.stop.set()
        self.thread.join(timeout=10)

    @property
    def max_gap(self) -> float:
        times = [t for t in self.arrivals if self.window <= t <= self.window_end]
        return max(b - a for a, b in zip(times, times[1:]))


# ----------------------------------------------------------------------------- audio headers


def test_hostile_audio_headers_are_a_400_at_once(whisper_server):
    """A 20 KB WAV claiming 1 Hz (16000x to resample: 5.5 GB) and a 1 Hz header on 2 MB
    are refused from the header in well under a second, the server's memory flat."""
    one_hz_small = wav(rate=1, frames=10_000)
    one_hz_large = wav(rate=1, frames=MiB)
    assert len(one_hz_small) < 21_000 and len(one_hz_large) > 2_000_000
    cases = [(one_hz_small, "sample rate is 1 Hz"), (one_hz_large, "sample rate is 1 Hz"),
             (wav(16000, 100, channels=9), "9 channels")]
    start_rss = rss_bytes()
    with httpx.Client(base_url=whisper_server.url, timeout=30) as client, Sampler(rss_bytes) as memory:
        for audio, message in cases:
            start = time.perf_counter()
            answer = client.post(TRANSCRIBE, files={"file": ("clip.wav", audio)})
            elapsed = time.perf_counter() - start
            error = answer.json()["error"]
            assert (answer.status_code, error["param"]) == (400, "file") and message in error["message"], error
            assert elapsed < 1.0, elapsed
    assert max(memory.values) - start_rss < 100 * MiB


def test_audio_over_max_audio_seconds_is_a_400(whisper_server):
    """The duration cap, from the header: a 3 s clip against --max-audio-seconds 2."""
    with RunningServer(whisper_server.engine, limits=replace(TEST_LIMITS, max_audio_seconds=2)) as running:
        answer = httpx.post(running.url + TRANSCRIBE, files={"file": ("clip.wav", wav(16000, 3 * 16000))})
        assert answer.status_code == 400 and "3.0 s long; at most 2 s" in answer.json()["error"]["message"]
        ok = httpx.post(running.url + TRANSCRIBE, files={"file": ("clip.wav", wav(16000, 16000))},
                        data={"max_output_tokens": "2"})
        assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


# ----------------------------------------------------------------------------- body limits


def test_a_50_mb_json_body_is_a_413_while_others_are_served(text):
    """Refused by its Content-Length before it is read, and (sent chunked, no length) as
    soon as the bytes read pass the limit; a concurrent stream keeps its pace and /health
    answers throughout. The senders are processes of their own, as hostile clients are."""
    with StreamGaps(text.url) as stream, HealthProbe(text.url) as health:
        answers = [subprocess.run([sys.executable, OUTSIDE, "post", text.url, COMPLETIONS, "50", framing],
                                  capture_output=True, text=True, timeout=60).stdout.splitlines()
                   for framing in ("length", "chunked")]
    for (status_line, body) in answers:
        status, sent_mib = status_line.rsplit(" ", 1)
        error = json.loads(body)["error"]
        assert status.startswith("HTTP/1.1 413") and error["type"] == "RequestTooLargeError", (status, error)
        assert "33554432" in error["message"] and "--max-request-body-bytes" in error["message"]
        assert int(sent_mib) < 50   # the rest was never read: the server closed the connection
    assert stream.max_gap < 0.2, stream.max_gap
    assert health.worst < 0.1, sorted(round(x * 1000) for x in health.latencies)[-5:]


def test_an_upload_over_the_cap_is_refused_while_it_streams(whisper_server):
    """A 40 MiB multipart upload gets its 413 once the body passes --max-upload-bytes and the
    form's overhead, not after it is spooled."""
    sent = []
    head = (b"--b\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"content-type: audio/wav\r\n\r\n")

    def upload():
        yield head
        for _ in range(40):
            sent.append(MiB)
            yield b"\0" * MiB
        yield b"\r\n--b--\r\n"

    answer = httpx.post(whisper_server.url + TRANSCRIBE, content=upload(),
                        headers={"content-type": "multipart/form-data; boundary=b"}, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 413 and error["param"] == "file", error
    assert "larger than the 27262976 bytes accepted" in error["message"]
    assert len(sent) < 40


def test_large_bodies_within_the_limit_do_not_hold_the_loop(text):
    """2 MB of prompt cannot fit 4096 tokens: a 400 at once (tokenizing 10 MB took ~18 s,
    all of it holding the event loop); a 100 KB one is tokenized off the loop; 20,000 chat
    messages are refused before pydantic validates them one by one. /health answers
    throughout (parsing JSON still costs the loop ~3-6 ms per MB: docs/architecture.md)."""
    def post(path: str, body: bytes) -> httpx.Response:
        return httpx.post(text.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)

    # encoded before the probe starts: this process's work is then only sending bytes
    huge, long = (json.dumps({"prompt": "hello world " * size}).encode() for size in (2 * MiB // 12, 8000))
    many = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 20_000}).encode()
    with HealthProbe(text.url) as health:
        start = time.perf_counter()
        refused = post(COMPLETIONS, huge)
        assert refused.status_code == 400 and "more than the context of 4096" in refused.json()["error"]["message"]
        assert time.perf_counter() - start < 2
        tokenized = post(COMPLETIONS, long)
        assert tokenized.status_code == 400 and "the context holds 4096" in tokenized.json()["error"]["message"]
        counted = post("/v1/chat/completions", many)
        assert counted.status_code == 400 and "at most 4096" in counted.json()["error"]["message"]
    assert health.worst < 0.1, sorted(round(x * 1000) for x in health.latencies)[-5:]


# ----------------------------------------------------------------------------- slow clients


def test_half_open_connections_are_closed_by_the_header_timeout(strict):
    """200 connections that send half a header are closed (a 408 first) once
    --timeout-header passes; /health answers throughout, and a slow body gets a 408."""
    sockets = []
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", strict.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        sockets.append(sock)
    closed: dict[socket.socket, bytes] = {}
    selector = selectors.DefaultSelector()
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    deadline = time.monotonic() + 3
    with HealthProbe(strict.url) as health:
        received = {sock: b"" for sock in sockets}
        while len(closed) < len(sockets) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.1):
                data = key.fileobj.recv(4096)
                received[key.fileobj] += data
                if not data:
                    closed[key.fileobj] = received[key.fileobj]
                    selector.unregister(key.fileobj)
    assert len(closed) == len(sockets)
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in closed.values())
    assert health.worst < 0.1, sorted(round(x * 1000) for x in health.latencies)[-5:]
    for sock in sockets:
        sock.close()

    with socket.create_connection(("127.0.0.1", strict.port)) as slow:   # the headers, then half the body
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"prompt\": ")
        slow.settimeout(5)
        answer = b"".join(iter(lambda: slow.recv(4096), b""))   # to the server's close
    assert answer.startswith(b"HTTP/1.1 408") and b"--timeout-body" in answer


def test_connections_past_the_cap_get_a_503(text):
    with RunningServer(text.engine, limits=replace(TEST_LIMITS, max_connections=8)) as running:
        idle = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(8)]
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", running.port)) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            extra.settimeout(5)
            answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower()
        for sock in idle:
            sock.close()
        time.sleep(0.1)
        assert httpx.get(running.url + "/health").status_code == 200


# ----------------------------------------------------------------------------- cross-site, hosts


def test_cross_site_requests_are_refused(strict, whisper_server):
    post = {"prompt": "Hi", "max_tokens": 2}
    foreign = httpx.post(strict.url + COMPLETIONS, json=post, headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403 and "--allowed-origins" in foreign.json()["error"]["message"]
    # a multipart upload from a web page: the form a browser sends without a preflight
    upload = httpx.post(whisper_server.url + TRANSCRIBE, files={"file": ("a.wav", wav(16000, 1600))},
                        headers={"Origin": "http://evil.example"})
    assert upload.status_code == 403
    # DNS rebinding: the page's own name in Origin and Host, on the loopback address
    rebound = httpx.post(whisper_server.url + TRANSCRIBE, files={"file": ("a.wav", wav(16000, 1600))},
                         headers={"Origin": f"http://evil.example:{whisper_server.port}",
                                  "Host": f"evil.example:{whisper_server.port}"})
    assert rebound.status_code == 403
    allowed = httpx.post(strict.url + COMPLETIONS, json=post, headers={"Origin": "https://app.example"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    same_origin = httpx.post(strict.url + COMPLETIONS, json=post, headers={"Origin": strict.url})   # its /docs page
    assert same_origin.status_code == 200
    assert httpx.get(strict.url + "/v1/models", headers={"Origin": "https://evil.example"}).status_code == 200
    wrong_host = httpx.post(strict.url + COMPLETIONS, json=post, headers={"Host": "evil.example"})
    assert wrong_host.status_code == 400 and "--allowed-hosts" in wrong_host.json()["error"]["message"]
    assert httpx.get(strict.url + "/health", headers={"Host": f"localhost:{strict.port}"}).status_code == 200


# ----------------------------------------------------------------------------- n, 500, model id


def test_n_is_bounded_and_counts_against_the_queue(text):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    over = httpx.post(text.url + "/v1/chat/completions", json={**chat, "n": 17})
    assert over.status_code == 400 and over.json()["error"]["param"] == "n" and "--max-n" in over.text
    assert httpx.post(text.url + "/v1/chat/completions", json={**chat, "n": 9}).status_code == 400   # holds 8
    long = {"prompt": "Hi", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", text.url + "/generate", json=long) as first, \
            httpx.stream("POST", text.url + "/generate", json=long) as second:
        lines = [first.iter_lines(), second.iter_lines()]   # kept: a dropped iterator closes its response
        assert all(next(line) for line in lines)
        full = httpx.post(text.url + "/v1/chat/completions", json={**chat, "n": 7})   # room for 6
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert text.engine.num_in_flight == 2   # none of the 7 was left behind
        fits = httpx.post(text.url + "/v1/chat/completions", json={**chat, "n": 6, "max_tokens": 1})
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 6
    text.wait_idle()


def test_a_500_says_internal_error_and_logs_the_rest(text, monkeypatch, caplog):
    from omniwalk.server import native

    def broken(*args):
        raise RuntimeError("secret detail of the host")

    monkeypatch.setattr(native, "to_generation_request", broken)
    with caplog.at_level(logging.ERROR, logger="omniwalk.server.app"):
        answer = httpx.post(text.url + "/generate", json={"prompt": "Hi"})
    message = answer.json()["error"]["message"]
    request_id = answer.headers["x-request-id"]
    assert answer.status_code == 500 and message == f"internal error (request id {request_id})"
    assert "secret" not in answer.text
    assert request_id in caplog.text and "secret detail of the host" in caplog.text


def test_a_folder_is_served_under_its_own_name(text, tmp_path):
    folder = tmp_path / "deep" / "My-Model"
    folder.mkdir(parents=True)
    loaded = text.engine.loaded
    text.engine.loaded = replace(loaded, name=str(folder))   # as a checkpoint folder would be named
    try:
        with RunningServer(text.engine) as running:
            [card] = httpx.get(running.url + "/v1/models").json()["data"]
    finally:
        text.engine.loaded = loaded
    assert card["id"] == "My-Model" and str(tmp_path) not in json.dumps(card)


def test_loop_error_reports_are_rate_limited(caplog):
    """The event loop reports a failing accept() once a second while descriptors run out."""
    now = [0.0]
    handler = RateLimitedLoopErrors(interval_s=10, clock=lambda: now[0])
    loop = type("Loop", (), {"default_exception_handler": lambda self, context: logging.getLogger(
        "asyncio").error(context["message"])})()
    context = {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.ERROR):
        for second in range(25):
            now[0] = float(second)
            handler(loop, context)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines   # at 0 s in full, then at 10 s and 20 s with the count left out
    assert "9 more like it" in lines[1]


# ----------------------------------------------------------------------------- soak


def clip_wav(seconds: float) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 16000, format="WAV")
    return buffer.getvalue()


SOAK_SECONDS = 12


def test_soak_mixed_good_bad_and_aborted_requests(text, tts_server, whisper_server):
    """Clients on text, speech and transcription, each a loop of good requests, bad ones
    (4xx) and ones they abandon mid-stream, for SOAK_SECONDS. After: no 5xx, every KV page
    and cross-attention slot back, exact outputs unchanged, this process's memory (the three
    servers' API side) within 150 MB of where it started."""
    speech = {"input": "Hello there", "voice": "tara", "max_output_tokens": 14, "seed": 3, "response_format": "pcm"}
    audio = clip_wav(1.0)
    exact = {
        "text": lambda: httpx.post(text.url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True,
                                                                 "temperature": 0}).json()["choices"][0]["text"],
        "speech": lambda: httpx.post(tts_server.url + "/v1/audio/speech", json=speech, timeout=30).content,
        "transcription": lambda: httpx.post(whisper_server.url + TRANSCRIBE, files={"file": ("a.wav", audio)},
                                            data={"max_output_tokens": "6"}, timeout=30).json()["text"],
    }
    before = {name: get() for name, get in exact.items()}
    start_rss = rss_bytes()
    statuses: list[int] = []
    stop = time.monotonic() + SOAK_SECONDS

    def text_client(i: int) -> None:
        with httpx.Client(base_url=text.url, timeout=30) as client:
            while time.monotonic() < stop:
                statuses.append(client.post(COMPLETIONS, json={"prompt": f"Hi {i}", "max_tokens": 16,
                                                               "n": 1 + i % 3}).status_code)
                statuses.append(client.post(COMPLETIONS, content=b'{"prompt": ', headers={
                    "content-type": "application/json"}).status_code)
                statuses.append(client.post("/v1/chat/completions", json={"messages": [], "n": 99}).status_code)
                with client.stream("POST", "/generate", json={"prompt": "Hi", "max_output_tokens": 500,
                                                              "ignore_eos": True, "stream": True}) as response:
                    statuses.append(response.status_code)
                    for _ in zip(range(3), response.iter_lines()):
                        pass   # then leave: the request is aborted

    def speech_client() -> None:
        with httpx.Client(base_url=tts_server.url, timeout=30) as client:
            while time.monotonic() < stop:
                statuses.append(client.post("/v1/audio/speech", json={**speech, "seed": None}).status_code)
                statuses.append(client.post("/v1/audio/speech", json={**speech, "voice": "nobody"}).status_code)
                with client.stream("POST", "/v1/audio/speech", json={**speech, "max_output_tokens": 700,
                                                                     "stream": True}) as response:
                    statuses.append(response.status_code)
                    next(response.iter_bytes())

    def transcription_client() -> None:
        with httpx.Client(base_url=whisper_server.url, timeout=30) as client:
            while time.monotonic() < stop:
                statuses.append(client.post(TRANSCRIBE, files={"file": ("a.wav", audio)},
                                            data={"max_output_tokens": "4"}).status_code)
                statuses.append(client.post(TRANSCRIBE, files={"file": ("a.wav", wav(1, 1000))}).status_code)
                with client.stream("POST", TRANSCRIBE, files={"file": ("a.wav", audio)},
                                   data={"stream": "true"}) as response:
                    statuses.append(response.status_code)
                    next(response.iter_lines())

    clients = [threading.Thread(target=text_client, args=(i,)) for i in range(3)]
    clients += [threading.Thread(target=speech_client), threading.Thread(target=transcription_client)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=SOAK_SECONDS + 30)
        assert not client.is_alive()

    assert statuses and max(statuses) < 500, sorted(set(statuses))
    assert {200, 400, 429} & set(statuses) >= {200, 400}
    for server in (text, tts_server, whisper_server):
        server.wait_idle(timeout=15)
    for server in (text, tts_server):
        free, total = server.engine.inspect(kv_pages)
        assert free == total
    free, slots = whisper_server.engine.inspect(cross_attention_slots)
    assert free == slots
    assert {name: get() for name, get in exact.items()} == before
    assert rss_bytes() - start_rss < 150 * MiB, (rss_bytes() - start_rss) / MiB
