"""The prefill steps of a wave of C Orpheus requests (the bench's prompts): each step's
length and where its host time goes, then a CUDA kernel profile of one mixed step
(prefill pieces + decode rows).

    PYTHONPATH=.:benchmarks/scripts python benchmarks/scripts/prefill_profile.py [C] [BUDGET] [PROFILED STEP]
"""
import os, sys, time

import torch
from torch.profiler import ProfilerActivity, profile

from omniwalk.bench.tts import TEXTS
from omniwalk.loading import EngineArgs, load_model
from omniwalk.models.orpheus.model import AUDIO_STREAM, CODES_STREAM, OrpheusPrompt
from omniwalk.models.orpheus.speech import SpeechRequest, speech_prompt
from omniwalk.runtime import Request, Runtime, SchedulerConfig, StopConfig, StreamParams
from omniwalk.runtime import runtime as runtime_module
from omniwalk.engine import causal_lm_executor as executor_module, cuda_graphs, sampler, seen_tokens, kv_cache
from phase_timers import acc, timed

for name in ("_forward_eager", "_decode_with_graph", "_sample", "_launch_lookahead", "_sample_on_device"):
    timed(executor_module.CausalLMExecutor, name)
timed(executor_module, "build_metadata") if hasattr(executor_module, "build_metadata") else None
for cls, name in ((cuda_graphs.HostCopy, "wait"), (cuda_graphs.DecodeGraphs, "run"), (sampler.Sampler, "__call__"),
                  (seen_tokens.SeenTokens, "gather"), (kv_cache.PagedKVCache, "reserve"),
                  (runtime_module.Runtime, "_form_batch"), (runtime_module.Runtime, "_advance_dirty")):
    timed(cls, name)

count = int(sys.argv[1]) if len(sys.argv) > 1 else 256
budget = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
profiled = int(sys.argv[3]) if len(sys.argv) > 3 else 4   # this step of the second wave runs under the profiler
cuda = torch.cuda.is_available()
loaded = load_model(EngineArgs("benchmarks/orpheus-3b" if cuda else "tiny-orpheus",
                               load_format="dummy" if cuda else "auto", max_num_seqs=count, max_model_len=2048,
                               quantization=os.environ.get("ORPHEUS_QUANTIZATION")))
model = loaded.served
engine_stub = type("E", (), {"tokenizer": loaded.tokenizer, "model": model,
                              "encode": lambda self, text, what: loaded.tokenizer.encode(text)})()
sync = torch.cuda.synchronize if cuda else (lambda: None)


def wave(runtime, offset):
    for i in range(count):
        speech = SpeechRequest(TEXTS[i % len(TEXTS)], voice="tara", max_output_tokens=70, ignore_eos=True, seed=i)
        runtime.add_request(Request(f"r{offset + i}", OrpheusPrompt(speech_prompt(engine_stub, speech)), {
            CODES_STREAM: StreamParams(70, StopConfig(eos_ids=frozenset({model.tokens.end_of_speech}), ignore_eos=True),
                                       speech.sampling(i), i),
            AUDIO_STREAM: StreamParams(seed=i)}))


for round in range(2):   # the first round warms every path
    runtime = Runtime(model, SchedulerConfig(count, budget))
    wave(runtime, round * count)
    lengths = []
    for step in range(12):
        sync(); start = time.perf_counter(); acc.clear()
        if round == 1 and step == profiled:
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
                runtime.step(); sync()
        else:
            runtime.step(); sync()
        lengths.append((time.perf_counter() - start) * 1e3)
        if round == 1:
            print(f"step {step}: {lengths[-1]:.1f} ms; " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in acc.most_common(9)))
    while runtime.has_unfinished:
        runtime.step()
print(p.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=int(os.environ.get("ROWS", 25)),
                             max_name_column_width=int(os.environ.get("WIDTH", 110))))
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=110))
