"""GPU time of one Orpheus-3B decode step (the decode graph's replay: forward + LM head) with
the fused norm + rotary + KV-write kernel and with the separate kernels it replaced (two
`norm_rotary`, two `index_copy_`), captured in one process, replayed back to back:

    PYTHONPATH=. python benchmarks/scripts/rotary_fusion_ab.py [ROWS ...]   (default 8 256)

Every row decodes at position 70 with a 70-token context on the scratch page (the step's
shape early in a wave; the pages' contents do not matter for timing). Dummy weights, FP8.
"""
import statistics, sys

import torch

from omniwalk.engine.attention import PagedAttention
from omniwalk.engine.cuda_graphs import capture_per_bucket
from omniwalk.kernels.norm_rotary import norm_rotary
from omniwalk.loading import EngineArgs, load_model

rows_list = [int(a) for a in sys.argv[1:]] or [8, 256]
loaded = load_model(EngineArgs("benchmarks/orpheus-3b", load_format="dummy", max_num_seqs=256, max_model_len=2048,
                               quantization="fp8", startup_warmup=False))
graphs = loaded.served.executors["backbone"].decode_graphs
graphs.positions.fill_(70)
graphs.context_lens.fill_(70)


def replay_ms(graph, replays: int = 200) -> float:
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(5):   # five blocks; the median block
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays // 5):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays // 5))
    return statistics.median(times)


fused = {rows: replay_ms(graphs.graphs[graphs.bucket_for(rows)][0]) for rows in rows_list}

original_forward = PagedAttention.forward


def separate_kernels(self, layer_index, query, key, value, scale, rotary=None):
    if rotary is not None:   # the ops before `norm_rotary_into_cache`
        query = norm_rotary(query, rotary.q_weight, rotary.eps, rotary.cos, rotary.sin, rotary.zero_centered)
        key = norm_rotary(key, rotary.k_weight, rotary.eps, rotary.cos, rotary.sin, rotary.zero_centered)
    return original_forward(self, layer_index, query, key, value, scale)


PagedAttention.forward = separate_kernels
with torch.inference_mode():
    separate = capture_per_bucket(graphs.device, sorted({graphs.bucket_for(r) for r in rows_list}), graphs._forward,
                                  warmups=2)
for rows in rows_list:
    old = replay_ms(separate[graphs.bucket_for(rows)][0])
    print(f"{rows} rows: decode graph {fused[rows]:.3f} ms fused, {old:.3f} ms with the separate kernels "
          f"({old - fused[rows]:+.3f})")
