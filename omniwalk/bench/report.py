"""What `omniwalk bench` prints and writes: the summary table, the failure banner, the JSON."""

from __future__ import annotations

import sys

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from omniwalk.bench.metrics import DEFINITIONS, RunSummary, Stats, summary_header


def machine_info() -> dict:
    import torch
    import transformers

    info = {
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "gpu": None, "gpu_count": 0, "omniwalk_commit": _commit(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def _commit() -> str | None:
    """$OMNIWALK_COMMIT when set (a copy of the tree whose .git lags its files, as on the GPU
    machine), else HEAD of the checkout the package runs from, "+dirty" when its tracked
    files differ from HEAD (then HEAD alone does not say what ran)."""
    if os.environ.get("OMNIWALK_COMMIT"):
        return os.environ["OMNIWALK_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        if not head:
            return None
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def _stats_row(name: str, stats: Stats | None, note: str = "") -> str:
    if stats is None:
        return f"  {name:<22}{'not measurable':>40}  {note}".rstrip()
    cells = "".join(f"{_ms(v):>10}" for v in (stats.mean, stats.p50, stats.p90, stats.p99))
    return f"  {name:<22}{cells}{stats.count:>10}  {note}".rstrip()


def format_summary(title: str, summary: RunSummary, hf: dict | None = None,
                   gpu_peak_bytes: int | None = None) -> str:
    s = summary
    ids = "counted from returned token ids" if s.id_based else f"counted from {s.count_source}"
    lines = summary_header(title, s) + [
        f"  prompt tokens         {s.prompt_tokens}",
        f"  output ids            {s.output_tokens} ({ids}); {s.output_tokens_received} received in all, "
        f"{s.requested_output_tokens} asked for",
        f"  request throughput    {s.request_throughput:.2f} req/s",
        f"  output throughput     {s.output_throughput:.1f} tok/s",
        f"  input throughput      {s.input_throughput:.1f} tok/s",
    ]
    if s.audio_seconds is not None:
        lines.append(f"  input audio           {s.audio_seconds:.1f} s, {s.audio_seconds_per_s:.2f} audio s / s")
    if gpu_peak_bytes is not None:
        lines.append(f"  GPU peak allocated    {gpu_peak_bytes / 2**30:.2f} GiB")
    lines += [
        f"  {'latency (ms)':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'samples':>10}",
        _stats_row("TTFT", s.ttft),
        _stats_row("TPOT", s.tpot),
        _stats_row("ITL per token", s.itl_per_token, "" if s.itl_per_token else "(the server sent no ids)"),
        _stats_row("ITL per chunk", s.itl_per_chunk, "(per chunk, not per token)"),
        _stats_row("E2E", s.e2e),
    ]
    if not s.id_based:
        lines.append(f"  NOTE: output counts are NOT id-based: the server returned no token ids ({s.count_source})")
    if hf is not None:
        lines += format_hf(hf)
    for item in s.failures[:5]:
        lines.append(f"  failed #{item['index']}: [{item['kind']}] {item['message']}")
    return "\n".join(lines)


def format_hf(hf: dict) -> list[str]:
    lines = [f"  HF generate baseline, batch {hf['batch_size']} x {hf['num_batches']} ({hf['device']}, {hf['dtype']}):"]
    for mode, result in hf["modes"].items():
        note = ""
        if mode == "static_compiled":
            note = f"  [{result['compile_backend']}/{result['compile_mode']}, {result['compiled_graphs']} graphs"
            note += f", {result['graphs_compiled_while_timed']} compiled while timed]"
            if result["compiled_graphs"] == 0:
                note += "  NOT COMPILED"
        lines.append(f"    {mode:<18}{result['output_tokens_per_s']:>12.1f} tok/s   {result['tokens_generated']} "
                     f"ids in {result['seconds']:.3f} s{note}")
    return lines


def format_definitions(definitions: dict[str, str] = DEFINITIONS) -> str:
    width = max(map(len, definitions))
    return "\n".join(["metric definitions:"] + [f"  {k:<{width}}  {v}" for k, v in definitions.items()])


def failure_banner(failed: int, total: int, where: str) -> str:
    line = "!" * 78
    return (f"{line}\n!!  BENCHMARK FAILED: {failed} of {total} requests failed ({where}).\n"
            f"!!  Figures cover completed requests only; the exit status is non-zero.\n{line}")


# ----------------------------------------------------------------------------- JSON


def write_json(path: str | Path, document: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")


def run_summary_where(runs: list[dict]) -> str:
    return ", ".join(f"{r['arrivals']}: {r['summary']['num_errors']} errors, "
                     f"{r['summary']['num_budget_violations']} budget violations" for r in runs)


def exit_status(failed: int, sent: int, where: str) -> int:
    """0, or print the failure banner (stdout and stderr) and return 1."""
    if not failed:
        return 0
    banner = failure_banner(failed, sent, where)
    print(banner, flush=True)
    print(banner, file=sys.stderr)
    return 1
