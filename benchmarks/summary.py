"""Print the raw JSON of `omniwalk bench` runs as the markdown rows of docs/benchmarks.md.

    python3 benchmarks/summary.py benchmarks/results/text-*.json

One block per file: where it ran (commit, GPU, date), the command, then one row per run.
Text runs: output tok/s, TTFT, TPOT, ITL, failures, and any HF baseline of the same call;
TTS runs (--tts): audio s per wall s, streaming-viable requests, TTFA, RTF; chat with audio
out (--speak): those and the text's TTFT and tok/s; ASR runs
(--asr): requests/s, audio s per wall s, RTFs, TTFT, latency. Standard library only.
"""

from __future__ import annotations

import json
import sys


def _num(value, digits=1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _pair(stats: dict | None, keys=("p50", "p99"), digits=1) -> str:
    if not stats:
        return "-"
    return " / ".join(_num(stats.get(k), digits) for k in keys)


def _text_rows(data: dict) -> list[str]:
    modes = []
    for run in data["runs"]:
        for mode in ((run.get("hf_baseline") or {}).get("modes") or {}):
            if mode not in modes:
                modes.append(mode)
    head = ["c", "output tok/s", "TTFT p50 / p99 (ms)", "TPOT p50 (ms)", "ITL p50 / p90 / p99 (ms)", "failed"]
    head += [f"HF {mode} tok/s" for mode in modes]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for run in data["runs"]:
        s, lat = run["summary"], run["summary"].get("latency_ms") or {}
        hf = (run.get("hf_baseline") or {}).get("modes") or {}
        cells = [str(run.get("concurrency") or run.get("arrivals")), _num(s.get("output_throughput")),
                 _pair(lat.get("ttft")), _num((lat.get("tpot") or {}).get("p50"), 2),
                 _pair(lat.get("itl_per_token"), ("p50", "p90", "p99"), 2),
                 f"{s.get('num_failed', 0)} of {s.get('num_requests')}"]
        cells += [_num((hf.get(mode) or {}).get("output_tokens_per_s")) for mode in modes]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _tts_rows(data: dict) -> list[str]:
    head = ["c", "audio s per wall s", "streaming viable", "TTFA p50 / p90 (ms)", "RTF p50", "failed"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for run in data["runs"]:
        s = run["summary"]
        lat = s.get("latency_ms") or {}
        cells = [str(run.get("concurrency")), _num(s.get("audio_throughput"), 2),
                 f"{s.get('num_viable')} of {s.get('num_with_audio')}", _pair(lat.get("ttfa"), ("p50", "p90")),
                 _num((s.get("rtf") or {}).get("p50"), 3), f"{s.get('num_failed', 0)} of {s.get('num_requests')}"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _speak_rows(data: dict) -> list[str]:
    head = ["c", "audio s per wall s", "streaming viable", "TTFA p50 / p90 (ms)", "RTF p50 / p90", "TTFT p50 (ms)",
            "text tok/s", "failed"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for run in data["runs"]:
        s = run["summary"]
        lat = s.get("latency_ms") or {}
        cells = [str(run.get("concurrency")), _num(s.get("audio_throughput"), 2),
                 f"{s.get('num_viable')} of {s.get('num_with_audio')}", _pair(lat.get("ttfa"), ("p50", "p90")),
                 _pair(s.get("rtf"), ("p50", "p90"), 3), _num((lat.get("ttft") or {}).get("p50")),
                 _num(s.get("output_throughput")), f"{s.get('num_failed', 0)} of {s.get('num_requests')}"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _asr_rows(data: dict) -> list[str]:
    head = ["c", "requests/s", "audio s per wall s", "run RTF", "request RTF p50 / p90", "TTFT p50 / p90 (ms)",
            "latency p50 (ms)", "failed"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for run in data["runs"]:
        s = run["summary"]
        cells = [str(run.get("concurrency")), _num(s.get("request_throughput"), 3),
                 _num(s.get("audio_seconds_per_second")), _num(s.get("run_rtf"), 4),
                 _pair(s.get("request_rtf"), ("p50", "p90"), 3), _pair(s.get("ttft_ms"), ("p50", "p90")),
                 _num((s.get("latency_ms") or {}).get("p50"), 0), f"{s.get('num_failed', 0)} of {s.get('num_requests')}"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def summarize(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    machine = data.get("machine") or {}
    mode = data.get("mode") or "text"
    rows = {"tts": _tts_rows, "speak": _speak_rows, "asr": _asr_rows}.get(mode, _text_rows)(data)
    where = (f"{path}: commit {machine.get('omniwalk_commit')}, {machine.get('gpu_count')} x {machine.get('gpu')}, "
             f"{machine.get('cpu_count')} CPUs, torch {machine.get('torch')}, {data.get('date')}")
    return "\n".join([where, f"  {data.get('command')}", *rows])


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    failed = 0
    for path in paths:
        try:
            print(summarize(path) + "\n")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"{path}: cannot read ({type(exc).__name__}: {exc})\n")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
