"""SNAC's 1x1 conv + residual add at snac_24khz's block shapes (64 windows): the Triton
kernel's tile sizes, warps, TF32 or not, against cuDNN's conv1d followed by the add.

    python3 benchmarks/scripts/pointwise_conv_sweep.py      (CUDA)
"""
import itertools, torch, triton
from omniwalk.kernels.snac import _pointwise_conv_kernel


def timed(fn, reps=20):
    for _ in range(2): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); [fn() for _ in range(reps)]; e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1e3


for channels, length in ((512, 128), (256, 1024), (128, 4096), (64, 8192)):
    batch = 64
    y = torch.randn(batch, channels, length, device="cuda"); x = torch.randn_like(y)
    w = torch.randn(channels, channels, 1, device="cuda"); b = torch.randn(channels, device="cuda")
    out = torch.empty_like(x)
    torch_us = timed(lambda: x + torch.nn.functional.conv1d(y, w, b))
    rows = []
    for tf32, block_o, block_t, block_i, warps, stages in itertools.product((True,), (32, 64, 128), (64, 128, 256), (16, 32), (4, 8), (2, 3)):
        if block_o > channels or block_i > channels: continue
        grid = (triton.cdiv(length, block_t), triton.cdiv(channels, block_o), batch)
        w2 = w.view(channels, channels)
        def call():
            _pointwise_conv_kernel[grid](y, w2, b, x, y, out, channels, channels, length, 0, HAS_BIAS=True, HAS_SCALE=False,
                                         TF32=tf32, BLOCK_O=block_o, BLOCK_T=block_t, BLOCK_I=block_i,
                                         num_warps=warps, num_stages=stages)
        try:
            rows.append((timed(call), tf32, block_o, block_t, block_i, warps, stages))
        except Exception:
            pass
    rows.sort()
    gb = 3 * y.numel() * 4 / 1e9
    print(f"C={channels} T={length} B={batch}: torch conv1d+add {torch_us:.1f} us; ideal at 4 TB/s {gb / 4e3 * 1e6:.1f} us", flush=True)
    for r in rows[:5]:
        print(f"   {r[0]:7.1f} us tf32={r[1]} BLOCK_O={r[2]} BLOCK_T={r[3]} BLOCK_I={r[4]} warps={r[5]} stages={r[6]}")
    shipped = [r for r in rows if r[1] and r[2] == min(64, channels) and r[3] == 128 and r[4] == 32 and r[5] == 4 and r[6] == 3]
    print(f"   shipped: {shipped[0][0] if shipped else float('nan'):.1f} us", flush=True)
