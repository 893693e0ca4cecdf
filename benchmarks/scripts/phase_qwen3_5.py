import sys, time, random, collections, functools, torch
from omniwalk.loading import EngineArgs, load_model
from omniwalk.runtime import Runtime, SchedulerConfig, Request, StreamParams, StopConfig
from omniwalk.runtime import runtime as rtmod
from omniwalk.engine import causal_lm_executor as ex, cuda_graphs as cg, sampler as sm, hybrid_lm_executor as hy
from omniwalk.models.text_lm import TextPrompt
from omniwalk.engine.sampler import SamplingParams
from phase_timers import acc, timed
for n in ("_advance_dirty", "_form_batch", "_run_batch"): timed(rtmod.Runtime, n)
for n in ("run", "_forward_eager", "_decode_with_graph", "_sample", "_launch_lookahead"): timed(ex.CausalLMExecutor, n)
timed(hy.HybridLMExecutor, "_commit_states")
timed(cg.DecodeGraphs, "run")
loaded = load_model(EngineArgs("benchmarks/qwen3.5-0.8b", load_format="dummy", max_num_seqs=128, max_model_len=1024, max_num_batched_tokens=8192))
graphs = loaded.served.executors["backbone"].decode_graphs
for b in (8, 128):
    g, _ = graphs.graphs[b]; torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): g.replay()
    torch.cuda.synchronize(); print(f"graph replay B={b}: {(time.perf_counter()-t)/20*1e3:.3f} ms", flush=True)
rng = random.Random(0)
for c in (8, 128):
    rt = Runtime(loaded.served, SchedulerConfig(128, 8192))
    for i in range(c):
        rt.add_request(Request(f"r{i}", TextPrompt([rng.randrange(1000, 100000) for _ in range(32)]),
            {"text": StreamParams(400, StopConfig(eos_ids=frozenset({1})), SamplingParams(temperature=0.0), i)}))
    torch.cuda.synchronize(); t = time.perf_counter(); rt.step(); torch.cuda.synchronize()
    print(f"c={c}: first (prefill) step {(time.perf_counter()-t)*1e3:.1f} ms", flush=True)
    for _ in range(5): rt.step()
    acc.clear(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(50): rt.step()
    total = (time.perf_counter() - t) / 50
    print(f"c={c}: {total*1e3:.3f} ms/step; " + ", ".join(f"{k} {v/50*1e3:.3f}" for k, v in acc.most_common()), flush=True)
    for rid in list(rt.running): rt.abort(rid)
    rt.step()
