"""Where the time to first audio goes in the bench's one wave of C speech requests: every
engine step of the wave (start, length, each node's calls and tokens) and the first-audio
arrival times, through the same Engine and in-process client as `omniwalk bench --tts`.

    PYTHONPATH=. python benchmarks/scripts/ttfa_timeline.py [C] [N] [--budgets 2048,8192] [--model PATH] [--quantization fp8]
        [--waves K]

One model load; a warm-up wave of 4 requests, then one wave of C requests (N codes each)
per prefill budget (max_num_batched_tokens). On a CPU it runs tiny-orpheus. With --waves K
the C-request wave is repeated K times on one engine and each wave is summarized in one
line (where its first audio went: intake, prefill, decode steps, the gaps between steps,
Triton compiles and garbage collections during it), to find what moves from wave to wave.
"""
import argparse, asyncio, dataclasses, gc, sys, time

import triton.runtime.jit

import torch

from omniwalk.api import Engine
from omniwalk.bench.tts import TEXTS
from omniwalk.bench.tts_backends import InProcessSpeechBackend, TTSRequest
from omniwalk.loading import EngineArgs, load_model
from omniwalk.runtime import runtime as runtime_module

parser = argparse.ArgumentParser()
parser.add_argument("streams", type=int, nargs="?", default=256)
parser.add_argument("codes", type=int, nargs="?", default=140)
parser.add_argument("--budgets", default="2048")
parser.add_argument("--model", default="benchmarks/orpheus-3b" if torch.cuda.is_available() else "tiny-orpheus")
parser.add_argument("--steps", type=int, default=45, help="steps of the timeline printed")
parser.add_argument("--quantization", default=None)
parser.add_argument("--waves", type=int, default=1, help="C-request waves per budget, each summarized")
parser.add_argument("--snac-stream-priority", type=int, default=None,
                    help="run the codec on a CUDA stream of this priority (lower is higher)")
parser.add_argument("--switch-interval-ms", type=float, default=None, help="sys.setswitchinterval (the GIL's)")
args = parser.parse_args()
if args.switch_interval_ms is not None:
    sys.setswitchinterval(args.switch_interval_ms / 1000)
base = EngineArgs(args.model, load_format="dummy" if args.model != "tiny-orpheus" else "auto",
                  max_num_seqs=args.streams, max_model_len=2048, quantization=args.quantization)
loaded = load_model(base)

steps: list[dict] = []
original_run_batch, original_step = runtime_module.Runtime._run_batch, runtime_module.Runtime.step


def run_batch(self, node, calls):
    steps[-1][node] = (len(calls), sum(call.num_tokens for call in calls))
    return original_run_batch(self, node, calls)


def step(self):
    steps.append({"start": time.perf_counter()})
    try:
        return original_step(self)
    finally:
        steps[-1]["end"] = time.perf_counter()


runtime_module.Runtime._run_batch, runtime_module.Runtime.step = run_batch, step

# (start, seconds) of each Triton compile and each garbage collection (generation, start, seconds)
compiles: list[tuple[float, float]] = []
collections: list[tuple[int, float, float]] = []
original_do_compile = triton.runtime.jit.JITFunction._do_compile


def do_compile(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return original_do_compile(self, *args, **kwargs)
    finally:
        compiles.append((start, time.perf_counter() - start))


triton.runtime.jit.JITFunction._do_compile = do_compile
collection_start = [0.0]


def on_collection(phase, info):
    if phase == "start":
        collection_start[0] = time.perf_counter()
    else:
        collections.append((info["generation"], collection_start[0], time.perf_counter() - collection_start[0]))


gc.callbacks.append(on_collection)


def wave(engine, count, codes):
    async def main():
        backend = InProcessSpeechBackend(engine, "tara", True)
        requests = [TTSRequest(i, TEXTS[i % len(TEXTS)], codes, i) for i in range(count)]
        return await asyncio.gather(*(backend.send(r) for r in requests))
    return asyncio.run(main())


def summarize(index, records):
    """One line: the wave's phases in ms from its first send, up to its first audio."""
    t0 = min(r.send_time for r in records)
    ms = lambda t: (t - t0) * 1e3
    first = sorted(ms(r.arrivals[0][0]) for r in records)
    own = sorted((r.arrivals[0][0] - r.send_time) * 1e3 for r in records)
    p90 = first[int(len(first) * 0.9)]
    before = [s for s in steps if ms(s["start"]) < p90]
    prefill = [s for s in before if any(units > calls for calls, units in
                                        (v for k, v in s.items() if k not in ("start", "end")))]
    windows = next((i for i, s in enumerate(steps) if "snac_decoder" in s), None)
    decode = [s for s in steps[len(prefill):windows or 0]]
    lengths = [ms(s["end"]) - ms(s["start"]) for s in decode]
    gaps = sum(ms(b["start"]) - ms(a["end"]) for a, b in zip(before, before[1:]))
    in_wave = lambda t: ms(t) < p90
    print(f"wave {index}: sent {ms(max(r.send_time for r in records)):.1f}; first step {ms(steps[0]['start']):.1f}; "
          f"prefill {len(prefill)} steps {sum(ms(s['end']) - ms(s['start']) for s in prefill):.1f}; "
          f"decode {len(lengths)} steps {sum(lengths):.1f} (mean {sum(lengths) / max(1, len(lengths)):.2f} "
          f"max {max(lengths, default=0):.2f}); windows step {windows} at "
          f"{ms(steps[windows]['start']) if windows is not None else float('nan'):.1f} "
          f"({ms(steps[windows]['end']) - ms(steps[windows]['start']) if windows is not None else 0:.2f}); "
          f"gaps {gaps:.1f}; first audio p50 {first[len(first) // 2]:.1f} p90 {p90:.1f}; own TTFA p50 "
          f"{own[len(own) // 2]:.1f} p90 {own[int(len(own) * 0.9)]:.1f}; compiles "
          f"{sum(1 for t, _ in compiles if in_wave(t))} ({sum(d for t, d in compiles if in_wave(t)) * 1e3:.1f} ms); "
          f"gc {[g for g, t, _ in collections if in_wave(t)].count(2)} gen2 "
          f"{sum(d for _, t, d in collections if in_wave(t)) * 1e3:.1f} ms", flush=True)


for budget in [int(b) for b in args.budgets.split(",")]:
    engine_args = dataclasses.replace(base, max_num_batched_tokens=budget)
    engine = Engine(engine_args, loaded=loaded)
    if args.snac_stream_priority is not None:
        engine.runtime.executors["snac_decoder"].stream = torch.cuda.Stream(priority=args.snac_stream_priority)
    try:
        wave(engine, 4, args.codes)
        for index in range(args.waves):
            steps.clear(); compiles.clear(); collections.clear()
            records = wave(engine, args.streams, args.codes)
            if args.waves > 1:
                summarize(index, records)
    finally:
        engine.shutdown()
    if args.waves > 1:
        continue
    assert all(r.error is None for r in records), [r.error for r in records if r.error][:3]
    t0 = min(r.send_time for r in records)
    first = sorted((r.arrivals[0][0] - t0) * 1e3 for r in records)
    sent = sorted((r.send_time - t0) * 1e3 for r in records)
    print(f"budget {budget}: {args.streams} requests sent over {sent[-1]:.1f} ms; first audio (from the first send) "
          f"p0 {first[0]:.0f} p50 {first[len(first) // 2]:.0f} p90 {first[int(len(first) * 0.9)]:.0f} "
          f"p100 {first[-1]:.0f} ms", flush=True)
    nodes = sorted({k for s in steps for k in s if k not in ("start", "end")})
    print("  step  start ms  length ms  " + "  ".join(f"{n} (calls, units)" for n in nodes))
    for i, s in enumerate(steps[:args.steps]):
        cells = "  ".join(f"{str(s.get(n, '')):>22}" for n in nodes)
        print(f"  {i:4d}  {(s['start'] - t0) * 1e3:8.1f}  {(s['end'] - s['start']) * 1e3:9.2f}  {cells}")
