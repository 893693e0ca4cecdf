"""Orpheus-3B's four projection GEMMs in FP8 (`torch._scaled_mm`, per-token x per-channel
scales) at a decode batch (M = 256) and a prefill wave (M = 10,816): time with and without
`use_fast_accum` (Hopper's FP8 accumulation without the periodic FP32 promotion), beside the
bf16 GEMM, and the error of each against the product of the dequantized operands in fp32.

    python benchmarks/scripts/fp8_gemm_sweep.py
"""
import torch

from omniwalk.kernels.fp8 import quantize_rows_reference

SHAPES = {"qkv": (3072, 5120), "o": (3072, 3072), "gate_up": (3072, 16384), "down": (8192, 3072)}


def timed(fn, reps=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3   # us


torch.manual_seed(0)
for m in (256, 10816):
    totals = {"bf16": 0.0, "fp8": 0.0, "fp8 fast accum": 0.0}
    for name, (k, n) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs = quantize_rows_reference(x)
        wq, ws = quantize_rows_reference(w)
        ws = ws.reshape(1, -1)
        reference = (xq.float() @ wq.float().t()) * xs * ws
        line = []
        for label, fn in [("bf16", lambda: x @ w.t()),
                          ("fp8", lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)),
                          ("fp8 fast accum", lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                                       out_dtype=torch.bfloat16, use_fast_accum=True))]:
            us = timed(fn)
            totals[label] += us
            error = ""
            if label != "bf16":
                out = fn().float()
                relative = ((out - reference).abs() / reference.abs().clamp_min(1e-3)).flatten()
                error = (f" max|err| {(out - reference).abs().max().item():.4f}, norm err "
                         f"{((out - reference).norm() / reference.norm()).item():.2e}, p99.9 rel {relative.quantile(0.999).item() if relative.numel() < 2**24 else relative[:2**24].quantile(0.999).item():.2e}")
            line.append(f"{label} {us:8.1f} us{error}")
        print(f"M={m} {name:8s} K={k} N={n}: " + " | ".join(line), flush=True)
    print(f"M={m} per layer: " + ", ".join(f"{k} {v:.1f} us" for k, v in totals.items())
          + f"; x 28 layers: " + ", ".join(f"{k} {v * 28 / 1e3:.2f} ms" for k, v in totals.items()), flush=True)
