"""`omniwalk generate` in-process and `omniwalk serve` as a real process."""

from __future__ import annotations

import argparse

import httpx
import numpy as np
import pytest
import soundfile

from omniwalk.cli import _engine_args, build_parser, main
from omniwalk.version import package_version
from processes import serve_process


def test_generate_prints_text_and_finish_reason(capsys):
    assert main(["generate", "tiny-qwen3", "Hello", "--max-tokens", "4", "--ignore-eos"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "[finish_reason=length prompt_tokens=3 output_tokens=4]"


def test_generate_stream_matches(capsys):
    assert main(["generate", "tiny-qwen3", "Hello", "--max-tokens", "5", "--ignore-eos", "--temperature", "1",
                 "--seed", "4"]) == 0
    full = capsys.readouterr().out
    assert main(["generate", "tiny-qwen3", "Hello", "--max-tokens", "5", "--ignore-eos", "--temperature", "1",
                 "--seed", "4", "--stream"]) == 0
    assert capsys.readouterr().out == full


def test_generate_bad_value_is_a_message(capsys):
    assert main(["generate", "tiny-qwen3", "Hello", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_serve_flags_become_engine_args():
    args = build_parser().parse_args([
        "serve", "--port", "0", "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "4", "--max-queue", "8",
        "--max-num-batched-tokens", "512", "--kv-cache-tokens", "4096", "--page-size", "32", "--seed", "3",
        "--max-model-len", "256", "--load-format", "dummy", "--gpu-memory-utilization", "0.5",
    ])
    assert args.model == "tiny-qwen3"
    engine_args = _engine_args(args)
    assert (engine_args.max_num_seqs, engine_args.max_queue, engine_args.max_num_batched_tokens) == (4, 8, 512)
    assert (engine_args.kv_cache_tokens, engine_args.page_size, engine_args.seed) == (4096, 32, 3)
    assert (engine_args.max_model_len, engine_args.load_format, engine_args.dtype) == (256, "dummy", "float32")
    assert engine_args.gpu_memory_utilization == 0.5 and engine_args.device == "cpu"


def test_serve_flags_become_server_limits():
    from omniwalk.server.app import server_limits
    from omniwalk.server.limits import ServerLimits

    args = build_parser().parse_args([
        "serve", "--max-request-body-bytes", "1000", "--max-upload-bytes", "2000", "--max-audio-seconds", "30",
        "--max-n", "4", "--timeout-header", "2", "--timeout-body", "3", "--timeout-keep-alive", "4",
        "--max-connections", "50", "--allowed-origins", "https://A.example/", "http://b.example:81",
        "--allowed-hosts", "example.com", "--allowed-hosts", "*.example.com",
    ])
    assert server_limits(args) == ServerLimits(
        max_request_body_bytes=1000, max_upload_bytes=2000, max_audio_seconds=30, max_n=4, timeout_header_s=2,
        timeout_body_s=3, timeout_keep_alive_s=4, max_connections=50,
        allowed_origins=("https://a.example", "http://b.example:81"), allowed_hosts=("example.com", "*.example.com"))
    assert server_limits(build_parser().parse_args(["serve"])) == ServerLimits()   # the flags' defaults are its own
    for bad in (["--max-n", "0"], ["--timeout-header", "0"], ["--allowed-origins", "example.com"]):
        with pytest.raises(ValueError):
            server_limits(build_parser().parse_args(["serve", *bad]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_serve_process(mode):
    with serve_process("--kv-cache-tokens", "2048", "--max-num-seqs", "8", mode) as (url, output):
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}).json()
        assert answer["usage"]["completion_tokens"] == 3
    assert "KV cache 2048 tokens" in output[0]
    assert "RANDOM weights" in output[0]
    assert ("engine loop in engine process" in output[0]) == (mode == "--engine-process"), output[0]


def test_serve_runs_an_engine_process_unless_told_not_to():
    assert _engine_args(build_parser().parse_args(["serve"])).engine_process
    assert not _engine_args(build_parser().parse_args(["serve", "--no-engine-process"])).engine_process
    assert not _engine_args(build_parser().parse_args(["generate", "tiny-qwen3", "Hi"])).engine_process
    assert _engine_args(build_parser().parse_args(["bench", "--engine-process"])).engine_process


# ----------------------------------------------------------------------------- issue 26: vLLM's habits


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"omniwalk {package_version()}"


def test_help_shows_every_flags_default():
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in commands.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and action.default is not argparse.SUPPRESS:
                assert "default" in formatter._get_help_string(action), (name, action.option_strings)
    assert "the port to listen on (default: 8000)" in " ".join(commands.choices["serve"].format_help().split())


@pytest.mark.parametrize("spelling, dtype", [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                                             ("float", "float32"), ("float32", "float32"), ("auto", "auto")])
def test_dtype_as_vllm_spells_it(spelling, dtype):
    assert _engine_args(build_parser().parse_args(["serve", "--dtype", spelling])).dtype == dtype


def test_vllm_serve_flags(monkeypatch):
    def parse(*argv):
        return build_parser().parse_args(["serve", *argv])

    assert parse("--served-model-name", "a", "b").served_model_name == ["a", "b"]
    assert _engine_args(parse()).enable_prefix_caching
    for flag in ("--no-enable-prefix-caching", "--no-prefix-caching"):
        assert not _engine_args(parse(flag)).enable_prefix_caching
    assert _engine_args(parse("--enable-prefix-caching")).enable_prefix_caching
    assert parse().api_key is None and parse("--api-key", "k").api_key == "k"
    monkeypatch.setenv("OMNIWALK_API_KEY", "from-env")
    assert parse().api_key == "from-env" and parse("--api-key", "k").api_key == "k"
    assert parse("--metrics-compat", "vllm", "--disable-log-stats").metrics_compat == "vllm"


def test_generate_speaks_into_a_file(tmp_path, capsys):
    path = tmp_path / "hello.wav"
    assert main(["generate", "tiny-orpheus", "Hello", "-o", str(path), "--max-tokens", "70", "--ignore-eos",
                 "--seed", "1"]) == 0
    samples, rate = soundfile.read(path, dtype="int16")
    out = capsys.readouterr().out.splitlines()
    assert rate == 24000 and out[-1].endswith(f"codes=70 frames=10 samples={len(samples)}]") and len(samples) > 0


def test_generate_transcribes_a_file(tmp_path, capsys):
    path = tmp_path / "talk.wav"
    soundfile.write(path, np.sin(np.arange(16000) / 10).astype(np.float32) * 0.3, 16000)
    assert main(["generate", "tiny-whisper", "--audio", str(path), "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "[finish_reason=length audio_seconds=1.00 output_tokens=4]"
    assert main(["generate", "tiny-whisper", "Hello"]) == 2   # a transcription model wants --audio
    assert "--audio" in capsys.readouterr().err
