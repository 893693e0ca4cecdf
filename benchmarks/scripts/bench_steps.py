"""`omniwalk bench ...` with every engine step recorded, then one line per wave (a prefill
after an idle engine): where its first ~30 steps went, how much of them the loop waited
for the GPU (a look-ahead step's ids: what is left is host time), and what else ran in
them (Triton compiles, garbage collections, growth of the CUDA caching allocator). To tell what makes
one run's one-wave TTFA slower than another's.

    PYTHONPATH=. python benchmarks/scripts/bench_steps.py bench --tts ...   (the bench's arguments)
"""
import gc, sys, time

import torch
import triton.runtime.jit

from omniwalk import cli
from omniwalk.bench import tts_backends
from omniwalk.engine import cuda_graphs
from omniwalk.runtime import runtime as runtime_module

steps: list[dict] = []
events: list[tuple[str, float, float]] = []   # (kind, start, seconds)
original_run_batch, original_step = runtime_module.Runtime._run_batch, runtime_module.Runtime.step
original_do_compile = triton.runtime.jit.JITFunction._do_compile
cuda = torch.cuda.is_available()


def run_batch(self, node, calls):
    steps[-1][node] = (len(calls), sum(call.num_tokens for call in calls))
    return original_run_batch(self, node, calls)


def step(self):
    steps.append({"start": time.perf_counter(), "reserved": torch.cuda.memory_reserved() if cuda else 0})
    try:
        return original_step(self)
    finally:
        steps[-1]["end"] = time.perf_counter()


original_wait = cuda_graphs.HostCopy.wait


def wait(self):
    # the loop thread waiting for a look-ahead step's ids: the step's GPU-bound share
    start = time.perf_counter()
    try:
        return original_wait(self)
    finally:
        if steps:
            steps[-1]["wait"] = steps[-1].get("wait", 0.0) + time.perf_counter() - start


def do_compile(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return original_do_compile(self, *args, **kwargs)
    finally:
        events.append(("compile", start, time.perf_counter() - start))


collection_start = [0.0]


def on_collection(phase, info):
    if phase == "start":
        collection_start[0] = time.perf_counter()
    else:
        events.append((f"gc{info['generation']}", collection_start[0], time.perf_counter() - collection_start[0]))


records = []   # the in-process speech client's records: send and arrival times
original_send = tts_backends.InProcessSpeechBackend.send


async def send(self, request):
    record = await original_send(self, request)
    records.append(record)
    return record


tts_backends.InProcessSpeechBackend.send = send
runtime_module.Runtime._run_batch, runtime_module.Runtime.step = run_batch, step
cuda_graphs.HostCopy.wait = wait
triton.runtime.jit.JITFunction._do_compile = do_compile
gc.callbacks.append(on_collection)
try:
    status = cli.main(sys.argv[1:])
finally:
    # a wave starts at a prefill the engine woke up for (it gathers a burst for >= 2 ms)
    is_prefill = lambda s: any(units > calls for calls, units in
                               (v for k, v in s.items() if k not in ("start", "end", "reserved", "wait")))
    waves = [i for i, s in enumerate(steps) if i == 0 or (s["start"] - steps[i - 1]["end"] > 0.0015 and is_prefill(s))]
    for number, first in enumerate(waves):
        window = steps[first:first + 30]
        t0, t1 = window[0]["start"], window[-1]["end"]
        prefill = [s for s in window if is_prefill(s)]
        lengths = [(s["end"] - s["start"]) * 1e3 for s in window]
        windows_at = next((i for i, s in enumerate(window) if "snac_decoder" in s), None)
        decode = window[len(prefill):]
        waited = sum(s.get("wait", 0.0) for s in decode) * 1e3 / max(1, len(decode))
        wave = steps[first:waves[number + 1] if number + 1 < len(waves) else None]
        wave_step = sum(s["end"] - s["start"] for s in wave) * 1e3 / len(wave)
        wave_wait = sum(s.get("wait", 0.0) for s in wave) * 1e3 / len(wave)
        near = [e for e in events if t0 <= e[1] < t1]
        kinds = sorted({e[0] for e in near})
        # the client's side of the wave: its requests were sent before its first step
        previous = steps[waves[number - 1]]["start"] if number else float("-inf")
        sent = [r for r in records if previous < r.send_time <= t0 and r.arrivals]
        client = ""
        if sent:
            s0 = min(r.send_time for r in sent)
            audio = sorted((r.arrivals[0][0] - s0) * 1e3 for r in sent)
            own = sorted((r.arrivals[0][0] - r.send_time) * 1e3 for r in sent)
            done = window[windows_at]["end"] if windows_at is not None else float("nan")
            client = (f"; sent over {(max(r.send_time for r in sent) - s0) * 1e3:.1f} ms, first step at "
                      f"{(t0 - s0) * 1e3:.1f}, windows launched by {(done - s0) * 1e3:.1f}, first audio p50 "
                      f"{audio[len(audio) // 2]:.1f} p90 {audio[int(len(audio) * 0.9)]:.1f}; own TTFA p90 "
                      f"{own[int(len(own) * 0.9)]:.1f}")
        print(f"wave {number} (step {first}, {len(steps[first:waves[number + 1] if number + 1 < len(waves) else None])} "
              f"steps, {steps[first]['backbone'][0]} requests): prefill {len(prefill)} steps {sum((s['end'] - s['start']) * 1e3 for s in prefill):.1f} ms "
              f"({sum(v[1] for s in prefill for k, v in s.items() if k == 'backbone')} tokens); first 30 steps "
              f"{(t1 - t0) * 1e3:.1f} ms, decode mean {sum(lengths[len(prefill):]) / max(1, len(lengths) - len(prefill)):.2f}"
              f" max {max(lengths[len(prefill):], default=0):.2f} (waiting for the GPU {waited:.2f}); all its steps"
              f" {wave_step:.2f} (waiting {wave_wait:.2f}); windows at step {windows_at}; reserved "
              f"+{(window[-1]['reserved'] - window[0]['reserved']) / 2**20:.0f} MiB"
              + ("; " if kinds else "") + ", ".join(f"{k} {sum(1 for e in near if e[0] == k)} ({sum(e[2] for e in near if e[0] == k) * 1e3:.1f} ms)"
                          for k in kinds) + client, flush=True)
sys.exit(status)
