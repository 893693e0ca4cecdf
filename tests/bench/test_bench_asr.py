"""`omniwalk bench --asr` on tiny-whisper: the counts it reports are the counts it produced."""

import json

from omniwalk.bench import asr
from omniwalk.cli import main


def test_asr_bench_counts_requests_audio_and_tokens(tmp_path, capsys):
    out = tmp_path / "asr.json"
    code = main(["bench", "--asr", "--model", "tiny-whisper", "--concurrency", "1,3", "--num-requests", "4",
                 "--warmup", "1", "--audio-seconds", "3", "--output-len", "5", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "asr" and not report["failed"]
    for run in report["runs"]:
        summary = run["summary"]
        assert summary["num_requests"] == 4 and summary["num_completed"] == 4
        assert summary["audio_seconds"] == 12.0
        assert 4 <= summary["output_tokens"] <= 4 * 5          # at most the budget, at least one id each
        assert abs(summary["run_rtf"] * summary["audio_seconds"] - summary["duration_s"]) < 1e-9
    assert "request RTF" in capsys.readouterr().out


def test_asr_bench_counts_failures_and_exits_nonzero(tmp_path, monkeypatch):
    real = asr._transcribe

    async def flaky(engine, index, clip, max_tokens, seed):
        record = await real(engine, index, clip, max_tokens, seed)
        if index == 1:
            record.error = "injected failure"
        return record

    monkeypatch.setattr(asr, "_transcribe", flaky)
    out = tmp_path / "asr.json"
    code = main(["bench", "--asr", "--model", "tiny-whisper", "--num-requests", "3", "--audio-seconds", "2",
                 "--output-len", "3", "--json", str(out), "--no-progress"])
    assert code == 1
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["num_failed"] == 1 and summary["failures"] == ["injected failure"]
