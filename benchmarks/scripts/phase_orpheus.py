"""Where an Orpheus-3B step goes on the GPU (dummy weights): phase timers + a CUDA kernel profile."""
import sys, time, collections, functools, torch
from torch.profiler import profile, ProfilerActivity
from omniwalk.loading import EngineArgs, load_model
from omniwalk.runtime import Runtime, SchedulerConfig, Request, StreamParams, StopConfig
from omniwalk.runtime import runtime as rtmod
from omniwalk.engine import causal_lm_executor as ex, cuda_graphs as cg, sampler as sm
from omniwalk.models.orpheus import model as om
from omniwalk.models.orpheus.model import OrpheusPrompt, CODES_STREAM, AUDIO_STREAM
from omniwalk.models.orpheus.speech import SpeechRequest
from phase_timers import acc, timed
for n in ("_advance_dirty", "_form_batch", "_run_batch"): timed(rtmod.Runtime, n)
for n in ("run", "_forward_eager", "_decode_with_graph", "_sample", "_launch_lookahead"): timed(ex.CausalLMExecutor, n)
timed(cg.DecodeGraphs, "run"); timed(sm.Sampler, "__call__"); timed(om.SnacDecoderExecutor, "run"); timed(om.AudioCodeMask, "candidate_rows")
from omniwalk.engine import seen_tokens as st, kv_cache as kc
timed(ex.CausalLMExecutor, "_sample_on_device"); timed(st.SeenTokens, "gather"); timed(kc.PagedKVCache, "reserve")
timed(cg.HostCopy, "wait"); timed(cg.DecodeGraphs, "copy_to_host"); timed(sm.Sampler, "process_logits")
from omniwalk.engine import sampling_graphs as sg
timed(sg.SamplingGraphs, "sample")
import os
cuda = torch.cuda.is_available()
sync = torch.cuda.synchronize if cuda else (lambda: None)
loaded = load_model(EngineArgs(os.environ.get("ORPHEUS_MODEL", "benchmarks/orpheus-3b"), load_format="dummy",
                               max_num_seqs=256, max_model_len=2048, kv_cache_tokens=None if cuda else 1 << 17,
                               quantization=os.environ.get("ORPHEUS_QUANTIZATION")))
model = loaded.served
for c in [int(x) for x in sys.argv[1:]] or [16, 256]:
    rt = Runtime(model, SchedulerConfig(256, 8192))
    for i in range(c):
        rt.add_request(Request(f"r{i}", OrpheusPrompt(list(range(300, 330))), {
            CODES_STREAM: StreamParams(1400, StopConfig(eos_ids=frozenset({model.tokens.end_of_speech}), ignore_eos=True),
                                       SpeechRequest("x", voice="tara").sampling(i), i),
            AUDIO_STREAM: StreamParams(seed=i)}))
    for _ in range(int(os.environ.get("PHASE_WARM", 30))): rt.step()   # context at measurement: 30 + this
    steps = int(os.environ.get("PHASE_STEPS", 40))
    acc.clear(); sync(); t = time.perf_counter()
    for _ in range(steps): rt.step()
    sync(); total = (time.perf_counter() - t) / steps
    print(f"c={c}: {total*1e3:.2f} ms/step ({c/total:.0f} codes/s); " + ", ".join(f"{k} {v/steps*1e3:.2f}" for k, v in acc.most_common()), flush=True)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        for _ in range(7): rt.step()
        sync()
    print(p.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=22, max_name_column_width=160))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=100))
    for rid in list(rt.running): rt.abort(rid)
    rt.step()
