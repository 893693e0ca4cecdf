"""Which Triton kernel variants a served Orpheus still compiles after the bench's warm-up:
each compile's kernel and specialization key, in the warm-up (8 requests), a wave of 256
split in two (161, then 95 while the first prefill runs, as a slow client sends them)
and a whole wave of 256.

    PYTHONPATH=. python benchmarks/scripts/compile_probe.py [--model PATH] [--codes N]
"""
import argparse, asyncio, dataclasses, time

import torch
import triton.runtime.jit

from omniwalk.api import Engine
from omniwalk.bench.tts import TEXTS
from omniwalk.bench.tts_backends import InProcessSpeechBackend, TTSRequest
from omniwalk.loading import EngineArgs, load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="benchmarks/orpheus-3b" if torch.cuda.is_available() else "tiny-orpheus")
parser.add_argument("--codes", type=int, default=60)
args = parser.parse_args()
engine_args = EngineArgs(args.model, load_format="dummy" if args.model != "tiny-orpheus" else "auto",
                         max_num_seqs=256, max_model_len=2048, max_num_batched_tokens=16384,
                         quantization="fp8" if torch.cuda.is_available() else None)
phase = ["load"]
load_compiles = [0]
original = triton.runtime.jit.JITFunction._do_compile


def do_compile(self, *a, **kw):
    start = time.perf_counter()
    kernel = original(self, *a, **kw)
    if phase[0] == "load":
        load_compiles[0] += 1
    else:
        name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?")
        print(f"[{phase[0]}] compiled {name} in {(time.perf_counter() - start) * 1e3:.0f} ms; key {str(a[0])[:400]}",
              flush=True)
    return kernel


triton.runtime.jit.JITFunction._do_compile = do_compile
loaded = load_model(engine_args)
print(f"load: {load_compiles[0]} compiles", flush=True)


async def send(engine, first, count, delay_s=0.0):
    await asyncio.sleep(delay_s)
    backend = InProcessSpeechBackend(engine, "tara", True)
    return await asyncio.gather(*(backend.send(TTSRequest(i, TEXTS[i % len(TEXTS)], args.codes, i))
                                  for i in range(first, first + count)))


async def split_wave(engine):
    return await asyncio.gather(send(engine, 0, 161), send(engine, 161, 95, 0.03))


phase[0] = "engine start (its warm-up requests)"
start = time.perf_counter()
engine = Engine(engine_args, loaded=loaded)
print(f"engine start: {time.perf_counter() - start:.2f} s", flush=True)
try:
    for name, run in [("warm-up 8", lambda: send(engine, 0, 8)), ("split 161 + 95", lambda: split_wave(engine)),
                      ("wave 256", lambda: send(engine, 0, 256)), ("wave 100", lambda: send(engine, 0, 100))]:
        phase[0] = name
        start = time.perf_counter()
        asyncio.run(run())
        print(f"{name}: {time.perf_counter() - start:.2f} s", flush=True)
finally:
    engine.shutdown()
