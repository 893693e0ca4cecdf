"""A text model's steps under the issue-7 workload (closed loop, outputs uniform in lo..hi):
decode-only steps vs steps where a prefill joins, with phase timers, then a profile.

    python3 benchmarks/scripts/phase_ranged.py MODEL CONCURRENCY [LO HI]
"""
import random, statistics, sys, time, torch
from torch.profiler import profile, ProfilerActivity
from omniwalk.loading import EngineArgs, load_model
from omniwalk.runtime import Runtime, SchedulerConfig, Request, StreamParams, StopConfig
from omniwalk.runtime import runtime as rtmod
from omniwalk.engine import causal_lm_executor as ex, cuda_graphs as cg, sampler as sm
from omniwalk.models.text_lm import TextPrompt
from omniwalk.engine.sampler import SamplingParams
from phase_timers import acc, timed

model, c = sys.argv[1], int(sys.argv[2])
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
lo, hi = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (128, 384)
for n in ("_advance_dirty", "_form_batch", "_run_batch", "_admit_waiting"): timed(rtmod.Runtime, n)
for n in ("run", "_forward_eager", "_decode_with_graph", "_sample", "_launch_lookahead", "_commit_states"):
    timed(ex.CausalLMExecutor, n)
timed(cg.DecodeGraphs, "run")
loaded = load_model(EngineArgs(model, load_format="dummy" if "/" in model else "auto", max_num_seqs=c, max_model_len=1024, max_num_batched_tokens=8192))
executor = loaded.served.executors["backbone"]
vocab = loaded.config.vocab_size
for name in ("run", "_forward_eager", "_commit_states", "_eager_inputs"):
    if name in type(executor).__dict__: timed(type(executor), name)
rt = Runtime(loaded.served, SchedulerConfig(c, 8192))
rng = random.Random(0)
count = 0


def refill():
    global count
    while len(rt.running) + len(rt.waiting) < c:
        prompt = TextPrompt([rng.randrange(100, min(100000, vocab)) for _ in range(32)])
        rt.add_request(Request(f"r{count}", prompt, {"text": StreamParams(
            rng.randint(lo, hi), StopConfig(eos_ids=frozenset({1}), ignore_eos=True), SamplingParams(temperature=0.0), count)}))
        count += 1


def steps(n):
    kinds = {"decode": [], "mixed": []}
    phases = {"decode": {}, "mixed": {}}
    tokens = 0
    for _ in range(n):
        refill()
        before = dict(acc)
        t = time.perf_counter()
        outs = rt.step()
        dt = time.perf_counter() - t
        tokens += sum(len(v) for o in outs for v in o.items.values())
        kind = "mixed" if acc["CausalLMExecutor._forward_eager"] > before.get("CausalLMExecutor._forward_eager", 0) else "decode"
        kinds[kind].append(dt)
        for k, v in acc.items():
            phases[kind][k] = phases[kind].get(k, 0) + v - before.get(k, 0)
    return kinds, phases, tokens


steps(300)  # reach the steady state (requests at staggered lengths)
sync()
used0, dropped0 = executor.lookahead_used, executor.lookahead_dropped
t = time.perf_counter()
kinds, phases, tokens = steps(300)
sync()
total = time.perf_counter() - t
print(f"{model} c={c} outputs {lo}..{hi}: {total / 300 * 1e3:.2f} ms/step, {tokens / total:.0f} tok/s; look-ahead used {executor.lookahead_used - used0}, "
      f"dropped {executor.lookahead_dropped - dropped0}", flush=True)
for kind, times in kinds.items():
    if not times: continue
    times.sort()
    print(f"  {kind}: {len(times)} steps, mean {statistics.mean(times)*1e3:.2f} p50 {times[len(times)//2]*1e3:.2f} "
          f"p90 {times[int(len(times)*.9)]*1e3:.2f} ms; per step: " +
          ", ".join(f"{k.split('.')[-1]} {v/len(times)*1e3:.2f}" for k, v in sorted(phases[kind].items(), key=lambda kv: -kv[1])[:9]), flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    steps(20)
    sync()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=160))
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=160))
