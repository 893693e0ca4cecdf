import torch
from torch.profiler import profile, ProfilerActivity
from omniwalk.loading import EngineArgs, load_model
loaded = load_model(EngineArgs("benchmarks/qwen3.5-0.8b", load_format="dummy", max_num_seqs=128, max_model_len=1024, max_num_batched_tokens=8192))
graphs = loaded.served.executors["backbone"].decode_graphs
with torch.inference_mode():
    for _ in range(3): graphs._forward(8)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        graphs._forward(8); torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
