"""SNAC's upsampling (Snake + transposed conv) at snac_24khz's four block shapes, 64 windows
of 4 frames: the Snake kernel + cuDNN's conv_transpose1d vs transposed_conv.py's fused
kernel (TF32 as served); then the whole decoder's forward for 64 windows.

    PYTHONPATH=. python benchmarks/scripts/snac_kernels.py      (on the GPU)
"""
import torch
import torch.nn.functional as F

from omniwalk.models.orpheus.snac import SNAC_24KHZ, SnacDecoder, init_random_snac
from omniwalk.models.orpheus.snake import snake
from omniwalk.models.orpheus.transposed_conv import snake_conv_transpose

WINDOWS = 64


def timed(fn, repeats=50):
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


torch.manual_seed(0)
for channels_in, channels_out, rate, length in ((1024, 512, 8, 16), (512, 256, 8, 128), (256, 128, 4, 1024),
                                               (128, 64, 2, 4096)):
    x = torch.randn(WINDOWS, channels_in, length, device="cuda")
    alpha = torch.rand(1, channels_in, 1, device="cuda") + 0.5
    conv = torch.nn.ConvTranspose1d(channels_in, channels_out, 2 * rate, rate, padding=(rate + 1) // 2,
                                    output_padding=rate % 2).cuda()
    taps_first = conv.weight.detach().permute(2, 1, 0).contiguous()
    with torch.inference_mode():
        def torch_way():
            return F.conv_transpose1d(snake(x, alpha), conv.weight, conv.bias, rate, conv.padding[0],
                                      conv.output_padding[0])

        def fused_way():
            return snake_conv_transpose(x, alpha, conv.weight, conv.bias, rate, conv.padding[0],
                                        conv.output_padding[0], taps_first)
        diff = (torch_way() - fused_way()).abs().max().item()
        print(f"{channels_in}->{channels_out} x{rate}, {length} steps: snake + cuDNN {timed(torch_way):8.1f} us, "
              f"fused {timed(fused_way):8.1f} us, max diff {diff:.2e}", flush=True)

decoder = SnacDecoder(SNAC_24KHZ).cuda()
init_random_snac(decoder, 0)
codes = [torch.randint(0, 4096, (WINDOWS, 4 * n), device="cuda") for n in (1, 2, 4)]
with torch.inference_mode():
    print(f"decoder forward, {WINDOWS} windows of 4 frames: {timed(lambda: decoder(codes), 20):.1f} us")
