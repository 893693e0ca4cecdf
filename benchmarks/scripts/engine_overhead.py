"""Does the in-process speech path (engine loop thread + output thread + asyncio client) slow
an Orpheus step down? One model load; the same wave of C requests (the bench's texts, N codes
each, ignore_eos) run through the Engine and the client, then through a bare Runtime.step loop.

    PYTHONPATH=. python benchmarks/scripts/engine_overhead.py [C] [N] [--model PATH]

Prints ms a step for each way; on a CPU it runs tiny-orpheus.
"""
import argparse, asyncio, gc, sys, time

import torch

from omniwalk.api import Engine
from omniwalk.bench.tts import TEXTS
from omniwalk.bench.tts_backends import InProcessSpeechBackend, TTSRequest
from omniwalk.loading import EngineArgs, load_model
from omniwalk.models.orpheus.model import AUDIO_STREAM, CODES_STREAM, OrpheusPrompt
from omniwalk.models.orpheus.speech import SpeechRequest, speech_prompt
from omniwalk.runtime import Request, Runtime, SchedulerConfig, StopConfig, StreamParams

parser = argparse.ArgumentParser()
parser.add_argument("streams", type=int, nargs="?", default=256)
parser.add_argument("codes", type=int, nargs="?", default=350)
parser.add_argument("--model", default="benchmarks/orpheus-3b" if torch.cuda.is_available() else "tiny-orpheus")
parser.add_argument("--ways", default="engine,engine-switch,engine-nogc,runtime")
args = parser.parse_args()
args_engine = EngineArgs(args.model, load_format="dummy" if args.model != "tiny-orpheus" else "auto",
                         max_num_seqs=args.streams, max_model_len=2048)
loaded = load_model(args_engine)


def requests():
    return [TTSRequest(i, TEXTS[i % len(TEXTS)], args.codes, i) for i in range(args.streams)]


def through_engine(switch: float | None = None, no_gc: bool = False) -> float:
    engine = Engine(args_engine, loaded=loaded)
    old_switch = sys.getswitchinterval()
    if switch:
        sys.setswitchinterval(switch)
    if no_gc:
        gc.disable()

    async def main():
        backend = InProcessSpeechBackend(engine, "tara", True)
        start_steps, start = engine.steps, time.perf_counter()
        records = await asyncio.gather(*(backend.send(r) for r in requests()))
        assert all(r.error is None for r in records), [r.error for r in records if r.error][:3]
        ttfa = sorted((r.arrivals[0][0] - r.send_time) * 1e3 for r in records)
        return engine.steps - start_steps, time.perf_counter() - start, ttfa
    try:
        steps, wall, ttfa = asyncio.run(main())
    finally:
        sys.setswitchinterval(old_switch)
        gc.enable()
        engine.shutdown()
    print(f"  {steps} engine steps, {wall / steps * 1e3:.2f} ms a step; TTFA p50 {ttfa[len(ttfa) // 2]:.0f} ms, "
          f"p90 {ttfa[int(len(ttfa) * 0.9)]:.0f} ms", flush=True)
    return wall / steps


def through_runtime() -> float:
    model = loaded.served
    runtime = Runtime(model, SchedulerConfig(args.streams, 8192))
    engine_stub = type("E", (), {"tokenizer": loaded.tokenizer, "model": model})()
    for r in requests():
        speech = SpeechRequest(r.text, voice="tara", max_output_tokens=r.max_output_tokens, ignore_eos=True, seed=r.seed)
        runtime.add_request(Request(f"r{r.index}", OrpheusPrompt(speech_prompt(engine_stub, speech)), {
            CODES_STREAM: StreamParams(r.max_output_tokens, StopConfig(eos_ids=frozenset({model.tokens.end_of_speech}),
                                                                      ignore_eos=True), speech.sampling(r.seed), r.seed),
            AUDIO_STREAM: StreamParams(seed=r.seed)}))
    steps, start = 0, time.perf_counter()
    while runtime.has_unfinished:
        runtime.step()
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    print(f"  {steps} runtime steps, {wall / steps * 1e3:.2f} ms a step", flush=True)
    return wall / steps


through_engine()   # warm: graphs, allocator, Triton
for way in args.ways.split(","):
    print(f"{way}: {args.streams} requests x {args.codes} codes", flush=True)
    if way == "runtime":
        through_runtime()
    elif way == "runtime-thread":
        import threading
        thread = threading.Thread(target=through_runtime)
        print("  torch threads (main)", torch.get_num_threads())
        thread.start()
        thread.join()
    else:
        through_engine(switch=0.0005 if way == "engine-switch" else None, no_gc=way == "engine-nogc")
