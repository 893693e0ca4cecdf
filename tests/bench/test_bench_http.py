"""`omniwalk bench` end to end: against the real server over HTTP, in-process, and against
fake servers that fail in known ways (the CLI must count them and exit non-zero)."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from omniwalk.bench.backends import OpenAICompletionsBackend
from omniwalk.bench.cli import resolve_tokenizer
from omniwalk.bench.workload import MEASURED, LengthRange, normal_vocabulary, synthetic_requests
from omniwalk.cli import main


def bench(tmp_path, *flags) -> tuple[int, dict]:
    path = tmp_path / "bench.json"
    code = main(["bench", *flags, "--json", str(path), "--no-progress"])
    return code, json.loads(path.read_text())


def expected_workload(num, input_len, output_len, seed):
    vocabulary = normal_vocabulary(resolve_tokenizer("tiny-qwen3"))
    return synthetic_requests(num, LengthRange.parse(input_len), LengthRange.parse(output_len), vocabulary,
                              seed, MEASURED)


@pytest.mark.slow
def test_real_server_counts_exactly(tiny_server, metric, tmp_path, capsys):
    generated_before = metric(tiny_server, "omniwalk_generation_tokens_total")
    code, report = bench(tmp_path, "--url", tiny_server + "/v1", "--concurrency", "1,4", "--input-len", "8:24",
                         "--output-len", "3:17", "--num-requests", "10", "--warmup", "2", "--ignore-eos",
                         "--seed", "3")
    assert code == 0, capsys.readouterr().out
    workload = expected_workload(10, "8:24", "3:17", 3)
    asked, prompt = sum(r.output_len for r in workload), sum(r.prompt_len for r in workload)
    assert [run["concurrency"] for run in report["runs"]] == [1, 4]
    for run in report["runs"]:
        s = run["summary"]
        assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (10, 10, 0)
        assert s["output_tokens"] == s["output_tokens_received"] == s["requested_output_tokens"] == asked
        assert s["prompt_tokens"] == prompt and s["id_based"]
        assert s["latency_ms"]["ttft"]["count"] == 10
        # one gap per id after each request's first chunk, which holds one id, or several when
        # the server joined chunks queued behind a reader that fell behind (RequestStream)
        per_token, per_chunk = (s["latency_ms"][k]["count"] for k in ("itl_per_token", "itl_per_chunk"))
        assert per_chunk <= per_token <= asked - 10 and per_token > 0
        assert run["warmup"]["num_requests"] == 2 and run["warmup"]["num_failed"] == 0
        # the server's own TTFT over the run's requests (warm-up included), read from its /metrics
        assert run["server_ttft"]["count"] == 12 and 0 < run["server_ttft"]["mean_ms"] < 60_000
    # what the server says it sent: 2 runs x (measured + warmup)
    warmup_asked = 2 * sum(r.output_len for r in synthetic_requests(
        2, LengthRange(8, 24), LengthRange(3, 17), normal_vocabulary(resolve_tokenizer("tiny-qwen3")), 3, 1))
    sent = metric(tiny_server, "omniwalk_generation_tokens_total") - generated_before
    assert sent == 2 * asked + warmup_asked
    assert report["command"].startswith("omniwalk bench --url")
    assert report["machine"]["cpu_count"] and report["date"] and report["config"]["ignore_eos"]
    assert "TTFT" in report["definitions"]
    out = capsys.readouterr().out
    assert "ITL per chunk" in out and "FAILED" not in out


def test_in_process_backend(tmp_path):
    code, report = bench(tmp_path, "--model", "tiny-qwen3", "--concurrency", "3", "--input-len", "16",
                         "--output-len", "2:9", "--num-requests", "7", "--ignore-eos", "--seed", "1",
                         "--max-num-seqs", "2")
    assert code == 0
    s = report["runs"][0]["summary"]
    assert s["num_completed"] == 7
    assert s["output_tokens"] == sum(r.output_len for r in expected_workload(7, "16", "2:9", 1))
    assert report["config"]["engine_args"]["max_num_seqs"] == 2
    assert report["runs"][0]["load_generator"] is None   # the engine shares the process: no figure


def test_poisson_arrivals(tiny_server, tmp_path):
    code, report = bench(tmp_path, "--url", tiny_server, "--request-rate", "50", "--input-len", "8",
                         "--output-len", "4", "--num-requests", "6", "--ignore-eos")
    assert code == 0
    run = report["runs"][0]
    assert run["concurrency"] is None and "Poisson" in run["arrivals"]
    assert run["summary"]["output_tokens"] == 24
    assert run["load_generator"]["processes"] == 1 and run["load_generator"]["cpu_fraction"] >= 0


def test_client_processes_split_the_load(tiny_server, tmp_path, capsys):
    """Two load generator processes, two requests in flight each: one run's records, merged."""
    code, report = bench(tmp_path, "--url", tiny_server, "--client-processes", "2", "--concurrency", "4",
                         "--input-len", "8", "--output-len", "2:6", "--num-requests", "8", "--warmup", "2",
                         "--ignore-eos", "--seed", "5")
    assert code == 0, capsys.readouterr()
    run = report["runs"][0]
    s = run["summary"]
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (8, 8, 0)
    assert s["output_tokens"] == sum(r.output_len for r in expected_workload(8, "8", "2:6", 5)) and s["id_based"]
    assert run["warmup"] == {"num_requests": 2, "num_failed": 0, "failures": []}
    assert run["load_generator"]["processes"] == 2 and run["load_generator"]["cpu_fraction"] >= 0
    assert report["config"]["client_processes"] == 2
    assert "load generator        2 processes, busiest at" in capsys.readouterr().out


# ----------------------------------------------------------------------------- fake servers


def fake_server(behaviour) -> FastAPI:
    """/v1/completions streaming `max_tokens` ids, unless `behaviour(n)` (n = 1, 2, ... in arrival
    order) says: "500", "short" (one id too few), "error-event", or "no-ids" (text and usage only)."""
    app = FastAPI()
    counter = itertools.count(1)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        kind = behaviour(next(counter))
        if kind == "500":
            return JSONResponse({"error": {"message": "injected failure", "code": 500}}, status_code=500)
        count = body["max_tokens"] - (kind == "short")

        async def events():
            for i in range(count):
                if kind == "error-event" and i == 1:
                    yield 'data: {"error": {"message": "died mid-stream", "code": 500}}\n\n'
                    break
                choice = {"index": 0, "text": "x", "finish_reason": "length" if i == count - 1 else None}
                if kind != "no-ids":
                    choice["token_ids"] = [7]
                yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
                await asyncio.sleep(0.001)
            else:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": count}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_failures_are_counted_and_exit_nonzero(serve, tmp_path, capsys):
    def behaviour(n: int) -> str:
        return "500" if n % 3 == 0 else "short" if n == 4 else "error-event" if n == 5 else "ok"

    with serve(fake_server(behaviour)) as url:
        code, report = bench(tmp_path, "--url", url, "--model", "fake", "--tokenizer", "tiny-qwen3",
                             "--concurrency", "2", "--input-len", "4", "--output-len", "5",
                             "--num-requests", "9", "--ignore-eos")
    assert code == 1
    s = report["runs"][0]["summary"]
    # requests 3, 6, 9: HTTP 500; 5: error event; 4: one id short of max_tokens
    assert (s["num_requests"], s["num_errors"], s["num_budget_violations"], s["num_completed"]) == (9, 4, 1, 4)
    assert report["failed"] and report["num_failed"] == 5
    assert report["runs"][0]["server_ttft"] is None   # a server without omniwalk's /metrics
    assert sorted(f["http_status"] for f in s["failures"] if f["kind"] == "error") == [200, 500, 500, 500]
    assert s["output_tokens"] == 4 * 5
    output = capsys.readouterr()
    assert "BENCHMARK FAILED: 5 of 9 requests failed" in output.out
    assert "BENCHMARK FAILED" in output.err


def test_server_without_ids_is_labelled(serve, tmp_path, capsys):
    with serve(fake_server(lambda n: "no-ids")) as url:
        code, report = bench(tmp_path, "--url", url, "--model", "fake", "--tokenizer", "tiny-qwen3",
                             "--concurrency", "2", "--input-len", "4", "--output-len", "6",
                             "--num-requests", "4", "--ignore-eos")
    assert code == 0
    s = report["runs"][0]["summary"]
    assert not s["id_based"] and "usage.completion_tokens (NOT id-based)" == s["count_source"]
    assert s["output_tokens"] == 24 and s["latency_ms"]["itl_per_token"] is None
    assert "NOT id-based" in capsys.readouterr().out


def test_transport_errors_are_recorded():
    def refuse(request: httpx.Request):
        raise httpx.ConnectError("connection refused", request=request)

    async def go():
        backend = OpenAICompletionsBackend("http://nowhere", "m", True, transport=httpx.MockTransport(refuse))
        try:
            return await backend.send(expected_workload(1, "4", "3", 0)[0])
        finally:
            await backend.aclose()

    record = asyncio.run(go())
    assert record.error.startswith("ConnectError") and record.end_time is not None


def test_the_client_runs_with_the_engines_quiet_collector_and_restores_it():
    """The load generator freezes what exists before a run and collects young objects rarely
    (as the engine does), so a full collection does not pause it mid-run; it restores both after."""
    import asyncio
    import gc

    from omniwalk.bench.backends import RequestRecord
    from omniwalk.bench.cli import _phases
    from omniwalk.engine_loop import GC_YOUNG_THRESHOLD

    seen = []

    class Backend:
        async def send(self, request):
            seen.append((gc.get_freeze_count(), gc.get_threshold()[0]))
            return RequestRecord(request, 1, 1, 0.0)

        async def aclose(self):
            pass

    before = gc.get_threshold()
    asyncio.run(_phases(Backend, [1], [2, 3], [0.0, 0.0], 2, "test", False))
    assert len(seen) == 3 and all(frozen > 0 and young >= GC_YOUNG_THRESHOLD for frozen, young in seen)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
