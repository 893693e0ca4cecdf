"""SNAC's transposed convolutions (snac_24khz's four upsampling shapes, 64 windows of 4
frames, fp32 with TF32 as served): cuDNN's default algorithm vs cuDNN in benchmark mode
(it times the algorithms on the first call) vs a TF32 GEMM + overlap-add; then the whole
decoder's forward for 64 windows, benchmark mode off and on, and decoding only the samples
a window emits (a request's first window, a centre, the final flush).

    PYTHONPATH=. python benchmarks/scripts/snac_upsample.py      (on the GPU)
"""
import torch
import torch.nn.functional as F

from omniwalk.models.orpheus.snac import SNAC_24KHZ, SnacDecoder, init_random_snac

WINDOWS = 64


def timed(fn, repeats=30):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3   # us


def gemm_fold(x, weight, bias, rate, padding):
    """conv_transpose1d for kernel 2 * rate as one GEMM ([B*L, I] @ [I, O*K]) and an overlap-add."""
    batch, channels_in, length = x.shape
    channels_out = weight.shape[1]
    y = (x.transpose(1, 2).reshape(-1, channels_in) @ weight.reshape(channels_in, -1))
    y = y.view(batch, length, channels_out, 2, rate).permute(0, 2, 3, 1, 4)   # [B, O, half, L, r]
    now = F.pad(y[:, :, 0].reshape(batch, channels_out, length * rate), (0, rate))
    before = F.pad(y[:, :, 1].reshape(batch, channels_out, length * rate), (rate, 0))
    return (now + before)[:, :, padding: padding + length * rate] + bias[:, None]


torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = True
with torch.inference_mode():
    for channels_in, channels_out, rate, length in ((1024, 512, 8, 16), (512, 256, 8, 128), (256, 128, 4, 1024),
                                                   (128, 64, 2, 4096)):
        x = torch.randn(WINDOWS, channels_in, length, device="cuda")
        conv = torch.nn.ConvTranspose1d(channels_in, channels_out, 2 * rate, rate, padding=(rate + 1) // 2,
                                        output_padding=rate % 2).cuda()
        row = f"{channels_in}->{channels_out} x{rate}, {length} steps:"
        for benchmark in (False, True):
            with torch.backends.cudnn.flags(enabled=True, benchmark=benchmark, deterministic=False, allow_tf32=True):
                row += f" cuDNN{' benchmark' * benchmark} {timed(lambda: conv(x)):7.1f} us,"
        expected = conv(x)
        diff = (gemm_fold(x, conv.weight, conv.bias, rate, conv.padding[0]) - expected).abs().max().item()
        row += f" GEMM + fold {timed(lambda: gemm_fold(x, conv.weight, conv.bias, rate, conv.padding[0])):7.1f} us"
        print(f"{row} (max diff {diff:.1e})", flush=True)
    decoder = SnacDecoder(SNAC_24KHZ).cuda()
    init_random_snac(decoder, 0)
    codes = [torch.randint(0, 4096, (WINDOWS, 4 * n), device="cuda") for n in (1, 2, 4)]
    for benchmark in (False, True):
        with torch.backends.cudnn.flags(enabled=True, benchmark=benchmark, deterministic=False, allow_tf32=True):
            print(f"decoder forward, {WINDOWS} windows, cudnn.benchmark={benchmark}: "
                  f"{timed(lambda: decoder(codes), 20):.1f} us", flush=True)
    # only the samples a window emits (SnacDecoder's keep): the first window, a centre, the final flush
    for name, keep in (("first window", (0, 4096)), ("centre", (2048, 4096)), ("final flush", (4096, 8192))):
        print(f"decoder forward, {WINDOWS} windows, {name} alone {keep}: "
              f"{timed(lambda: decoder(codes, keep=keep), 20):.1f} us", flush=True)
