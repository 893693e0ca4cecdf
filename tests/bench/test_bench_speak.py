"""`omniwalk bench --speak`: chat answered in text and audio on tiny-qwen3-omni, in-process and
over real HTTP loopback (the chat route streamed in pcm16), with exact text ids, frames and
samples per request; failures of a fake server counted; bad flags refused."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from omniwalk.api import Engine
from omniwalk.bench.cli import resolve_tokenizer
from omniwalk.bench.runner import run_phase
from omniwalk.bench.speak import speak_requests
from omniwalk.bench.speak_backends import ChatAudioSSEBackend, InProcessSpokenChatBackend, SpokenChatRecord
from omniwalk.bench.speak_metrics import failure, summarize_speak
from omniwalk.bench.workload import MEASURED, WARMUP, LengthRange, normal_vocabulary, synthetic_requests
from omniwalk.capabilities import Capability
from omniwalk.cli import main
from omniwalk.loading import EngineArgs

from conftest import serve_app

MODEL = "tiny-qwen3-omni"
# tiny-qwen3-omni's Code2Wav: F frames are F * 96 - 32 samples (the released model: F * 1920 - 555)
SAMPLES_PER_FRAME, LOOKAHEAD = 96, 32


def samples_of(frames: int) -> int:
    return frames * SAMPLES_PER_FRAME - LOOKAHEAD


def workload(num: int, input_len: str, output_len: str, frames: str, seed: int, stream: int = MEASURED):
    tokenizer = resolve_tokenizer(MODEL)
    text = synthetic_requests(num, LengthRange.parse(input_len), LengthRange.parse(output_len),
                              normal_vocabulary(tokenizer), seed, stream)
    return speak_requests(text, tokenizer, LengthRange.parse(frames), seed, stream)


def bench(tmp_path, *flags) -> tuple[int, dict]:
    path = tmp_path / "speak.json"
    code = main(["bench", "--speak", *flags, "--json", str(path), "--no-progress"])
    return code, json.loads(path.read_text())


@pytest.fixture(scope="module")
def omni_engine():
    engine = Engine(EngineArgs(MODEL))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def omni_server(omni_engine):
    from omniwalk.server.app import build_app

    with serve_app(build_app(omni_engine)) as url:
        yield url


def check_records(records: list[SpokenChatRecord], requests) -> None:
    """Every request answered exactly as asked: its text ids, frames and samples."""
    for record, request in zip(sorted(records, key=lambda r: r.index), requests):
        assert record.error is None and record.finish_reason == "length"
        assert record.output_tokens == record.usage_tokens == request.max_tokens
        assert record.usage_frames == request.max_frames
        assert record.samples == samples_of(request.max_frames)
        assert record.audio.audio_seconds == pytest.approx(samples_of(request.max_frames) / 24000)
        assert record.audio_arrivals[0][0] >= record.send_time and record.text_arrivals
        assert failure(record, ignore_eos=True) is None


# ----------------------------------------------------------------------------- per request


def test_frontend_says_how_many_samples_frames_make(omni_engine):
    frontend = omni_engine.frontend(Capability.TEXT)
    assert [frontend.audio_samples(f) for f in (1, 4, 40)] == [samples_of(f) for f in (1, 4, 40)]
    assert frontend.audio_sample_rate == 24000


@pytest.mark.parametrize("over_http", [False, True])
def test_each_request_gets_exactly_its_budgets(omni_engine, omni_server, over_http):
    requests = workload(4, "3:10", "2:6", "1:30", seed=5)
    assert len({r.max_frames for r in requests}) > 1   # the budgets differ per request

    async def run():
        backend = (ChatAudioSSEBackend(omni_server, MODEL, "ethan", ignore_eos=True) if over_http
                   else InProcessSpokenChatBackend(omni_engine, "Ethan", ignore_eos=True))
        try:
            return await run_phase(backend, requests, [0.0] * len(requests), 2)
        finally:
            await backend.aclose()

    records = asyncio.run(run()).records
    check_records(records, requests)
    # in-process the bench knows the samples its frames make; over HTTP it counts what came
    assert all((r.expected_samples is None) == over_http for r in records)
    # streamed: the audio of a request of more than Code2Wav's first chunk (4 frames) comes in parts
    long = [r for r in records if r.requested_frames > 8]
    assert long and all(len(r.audio_arrivals) >= 2 for r in long)


def test_http_payload_asks_for_streamed_pcm16_with_usage():
    [request] = workload(1, "5", "7", "33", seed=1)
    body = ChatAudioSSEBackend("http://nowhere/v1", MODEL, "Chelsie", ignore_eos=True).payload(request)
    assert body["modalities"] == ["text", "audio"]
    assert body["audio"] == {"voice": "Chelsie", "format": "pcm16", "max_frames": 33}
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["seed"] == request.seed
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["return_token_ids"]
    assert body["messages"] == [{"role": "user", "content": request.content}]


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 3072, 61440])
def test_audio_data_is_measured_not_decoded(size):
    """The client counts an audio delta's bytes from its base64 without decoding it; the rest
    of the event is as json.loads gives it, and anything unusual is decoded in full."""
    from omniwalk.bench.speak_backends import _AUDIO_SIZE, parse_event

    data = base64.b64encode(bytes(size)).decode()
    event = {"id": "x", "choices": [{"index": 0, "delta": {"audio": {
        "id": "a", "transcript": 'say "data": "AA=="', "data": data, "expires_at": 1}}, "token_ids": []}]}
    parsed = parse_event(json.dumps(event))
    assert parsed.pop(_AUDIO_SIZE) == size
    event["choices"][0]["delta"]["audio"]["data"] = ""
    assert parsed == event
    compact = json.dumps({"a": {"data": data}, "b": {"data": "AA=="}}, separators=(",", ":"))
    assert parse_event(compact) == json.loads(compact)                       # two "data" keys
    assert parse_event('{"data": "AA\\/A"}') == {"data": "AA/A"}               # an escape


def test_workload_renders_the_chat_and_draws_frames_apart_from_prompts():
    requests = workload(6, "4", "3", "10:20", seed=9)
    tokenizer = resolve_tokenizer(MODEL)
    for request in requests:
        assert tokenizer.decode(request.prompt_token_ids).endswith("<|im_start|>assistant\n")
        assert request.content in tokenizer.decode(request.prompt_token_ids)
        assert 10 <= request.max_frames <= 20 and request.max_tokens == 3
    assert [r.content for r in requests] == [r.content for r in workload(6, "4", "3", "30", seed=9)]
    assert [r.max_frames for r in requests] != [r.max_frames for r in workload(6, "4", "3", "10:20", 9, WARMUP)]


def test_a_sample_count_off_the_frames_is_a_budget_violation():
    record = SpokenChatRecord(0, 10, 2, 3, send_time=0.0, text_arrivals=[(0.1, 2)], audio_arrivals=[(0.2, 100)],
                              end_time=0.5, finish_reason="length", usage_tokens=2, usage_frames=3,
                              expected_samples=(samples_of(3),))
    assert failure(record, ignore_eos=True) == ("budget", f"received 100 samples; 3 frames are {samples_of(3)}")
    record.audio_arrivals = [(0.2, samples_of(2))]
    record.expected_samples = (samples_of(2), samples_of(3))   # without ignore_eos: the last may be EOS
    assert failure(record, ignore_eos=False) is None
    record.usage_frames, record.expected_samples = 2, None
    assert failure(record, ignore_eos=True) == ("budget", "2 of 3 audio frames with ignore_eos")
    assert failure(record, ignore_eos=False) is None      # the codec's EOS may end the audio early
    record.usage_frames = 4
    assert failure(record, ignore_eos=False) == ("budget", "4 audio frames for max_frames=3")


# ----------------------------------------------------------------------------- the CLI


def test_in_process_cli(tmp_path, capsys):
    code, report = bench(tmp_path, "--model", MODEL, "--concurrency", "1,3", "--input-len", "3:9",
                         "--output-len", "2:5", "--audio-frames", "4:24", "--num-requests", "5", "--warmup", "1",
                         "--ignore-eos", "--seed", "2", "--max-num-seqs", "2")
    out = capsys.readouterr().out
    assert code == 0, out
    requests = workload(5, "3:9", "2:5", "4:24", seed=2)
    frames = sum(r.max_frames for r in requests)
    samples = sum(samples_of(r.max_frames) for r in requests)
    assert report["mode"] == "speak" and report["config"]["voice"] == "Ethan"
    assert report["config"]["audio_frames"] == "4:24" and report["config"]["engine_args"]["max_num_seqs"] == 2
    assert [run["concurrency"] for run in report["runs"]] == [1, 3]
    for run in report["runs"]:
        s = run["summary"]
        assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (5, 5, 0)
        assert s["output_tokens"] == s["requested_output_tokens"] == sum(r.max_tokens for r in requests)
        assert s["frames"] == s["requested_frames"] == frames
        assert s["samples"] == s["samples_received"] == samples
        assert s["audio_seconds"] == pytest.approx(samples / 24000)
        assert s["prompt_tokens"] == sum(r.prompt_len for r in requests)
        latency = s["latency_ms"]
        assert latency["ttft"]["count"] == latency["ttfa"]["count"] == s["rtf"]["count"] == s["num_with_audio"] == 5
        assert latency["tpot"]["count"] == sum(r.max_tokens > 1 for r in requests)
        assert 0 <= s["num_viable"] <= 5 and s["audio_throughput"] > 0
        assert run["warmup"] == {"num_requests": 1, "num_failed": 0, "failures": []}
    assert {"TTFT", "TTFA", "RTF", "streaming viable", "audio throughput"} <= set(report["definitions"])
    assert "TTFA (audio)" in out and "FAILED" not in out


def test_over_http_cli(omni_server, tmp_path, capsys):
    code, report = bench(tmp_path, "--url", omni_server + "/v1", "--concurrency", "2", "--input-len", "3:9",
                         "--output-len", "2:5", "--audio-frames", "4:24", "--num-requests", "4", "--ignore-eos",
                         "--seed", "4", "--voice", "aiden")
    assert code == 0, capsys.readouterr().out
    requests = workload(4, "3:9", "2:5", "4:24", seed=4)
    s = report["runs"][0]["summary"]
    assert report["config"]["model"] == MODEL and report["config"]["engine_args"] is None
    assert (s["num_completed"], s["num_failed"]) == (4, 0)
    assert s["output_tokens"] == sum(r.max_tokens for r in requests)
    # the frames from the streamed usage (completion_tokens_details.audio_tokens), the samples from the deltas
    assert s["frames"] == sum(r.max_frames for r in requests)
    assert s["samples"] == sum(samples_of(r.max_frames) for r in requests)


def test_without_ignore_eos_the_codec_eos_ends_audio_early(tmp_path):
    """Random weights say codec EOS now and then: only ignore_eos makes the frames exact."""
    flags = ("--model", MODEL, "--input-len", "4", "--output-len", "3", "--audio-frames", "64",
             "--num-requests", "3", "--seed", "1", "--max-num-seqs", "4")
    code, report = bench(tmp_path, *flags)
    s = report["runs"][0]["summary"]
    assert code == 0 and s["num_failed"] == 0
    assert s["frames"] < s["requested_frames"] == 3 * 64
    # every request's samples matched its frames (num_failed 0): all heard, or all but a stopping codec EOS
    assert s["frames"] * SAMPLES_PER_FRAME - 3 * (SAMPLES_PER_FRAME + LOOKAHEAD) <= s["samples"]
    assert s["samples"] <= s["frames"] * SAMPLES_PER_FRAME - 3 * LOOKAHEAD


# ----------------------------------------------------------------------------- failures and flags


def fake_chat_server(frames_reported: int | None) -> FastAPI:
    """/v1/chat/completions streaming 2 text ids and 100 samples, its usage reporting
    `frames_reported` audio frames (None: no completion_tokens_details)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        def events():
            pcm = base64.b64encode(b"\0\0" * 100).decode()
            delta = {"audio": {"id": "a", "transcript": "hi", "data": pcm}}
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "token_ids": [5, 6],
                                                      "finish_reason": "length"}]}) + "\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": 2 + (frames_reported or 0)}
            if frames_reported is not None:
                usage["completion_tokens_details"] = {"text_tokens": 2, "audio_tokens": frames_reported}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("frames, kind, message", [
    (3, "budget", "3 of 8 audio frames with ignore_eos"),
    (9, "budget", "9 audio frames for max_frames=8"),
    (None, "error", "no audio frames in the usage"),
])
def test_fake_server_failures_are_counted(tmp_path, capsys, frames, kind, message):
    with serve_app(fake_chat_server(frames)) as url:
        code, report = bench(tmp_path, "--url", url, "--model", MODEL, "--output-len", "2", "--audio-frames", "8",
                             "--num-requests", "2", "--ignore-eos")
    assert code == 1 and report["failed"] and report["num_failed"] == 2
    [first, _] = report["runs"][0]["summary"]["failures"]
    assert (first["kind"], first["message"]) == (kind, message)
    assert "BENCHMARK FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--speak", "--model", "tiny-qwen3"], "does not speak"),
    (["--speak", "--voice", "nobody"], "--voice 'nobody'"),
    (["--speak", "--tts"], "not with --tts"),
    (["--speak", "--audio-seconds", "2"], "--audio-seconds"),
    (["--audio-frames", "5", "--model", "tiny-qwen3"], "--audio-frames is the frame budget of --speak"),
    (["--speak", "--audio-frames", "0"], "length range"),
])
def test_bad_flags_exit_2(flags, message, capsys):
    assert main(["bench", *flags, "--num-requests", "1", "--output-len", "2", "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_summary_of_no_completed_requests_has_no_figures():
    record = SpokenChatRecord(0, 4, 2, 3, send_time=1.0, end_time=2.0, error="HTTP 400: no voice")
    s = summarize_speak([record], 1.0, 2.0, ignore_eos=True)
    assert (s.num_completed, s.num_errors, s.frames, s.viable_fraction, s.ttfa.count) == (0, 1, 0, None, 0)
