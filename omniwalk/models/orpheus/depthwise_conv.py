"""SNAC's depthwise (one filter per channel) 7-tap convolutions as one Triton kernel.

PyTorch runs a depthwise `Conv1d` in fp32 through its generic native kernel
(`conv_depthwise2d_forward_kernel_generic`), which at 256 streams on the H200 was the
largest single item of a decoding step's CUDA time (~1.8 ms of ~12). Each output is
seven multiply-adds over a dilated window, so the kernel reads the input once per tap
from cache and writes once; the sum is in fp32 in tap order (not cuDNN's order: results
agree to float rounding).
"""

from __future__ import annotations

import torch
from torch import nn

from omniwalk.kernels.triton_support import triton, use_triton

if triton is not None:
    import triton.language as tl


class DepthwiseConv1d(nn.Conv1d):
    """`nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2,
    groups=channels)`: same parameters and names, so checkpoints load as for `nn.Conv1d`;
    one Triton kernel on CUDA."""

    def __init__(self, channels: int, kernel_size: int, dilation: int = 1):
        if (kernel_size - 1) * dilation % 2:
            raise ValueError("a length-preserving depthwise conv needs an even (kernel_size - 1) * dilation")
        super().__init__(channels, channels, kernel_size, dilation=dilation,
                         padding=dilation * (kernel_size - 1) // 2, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [B, C, T] -> [B, C, T]
        if not use_triton(x):
            return super().forward(x)
        return depthwise_conv1d(x, self.weight, self.bias, self.dilation[0], self.padding[0])


def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
                     padding: int, snake_alpha: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T], weight [C, 1, K] -> [B, C, T] (stride 1, zero padding, same length).
    `snake_alpha` [1, C, 1]: Snake applied to the result in the same pass (as snake.py)."""
    batch, channels, length = x.shape
    taps = weight.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    block = min(1024, triton.next_power_of_2(length))
    _depthwise_conv_kernel[(batch * channels, triton.cdiv(length, block))](
        x, weight, bias if bias is not None else weight, snake_alpha if snake_alpha is not None else weight, out,
        channels, length, dilation, padding,
        TAPS=taps, HAS_BIAS=bias is not None, SNAKE=snake_alpha is not None, BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _depthwise_conv_kernel(x_ptr, weight_ptr, bias_ptr, alpha_ptr, out_ptr, channels, length, dilation, padding,
                               TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, SNAKE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)                     # batch * channels + channel
        channel = row % channels
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < length
        base = x_ptr + row.to(tl.int64) * length
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for tap in tl.static_range(TAPS):
            source = cols + tap * dilation - padding
            inside = mask & (source >= 0) & (source < length)
            value = tl.load(base + source, mask=inside, other=0.0).to(tl.float32)
            acc += tl.load(weight_ptr + channel * TAPS + tap).to(tl.float32) * value
        if HAS_BIAS:
            acc += tl.load(bias_ptr + channel).to(tl.float32)
        if SNAKE:   # the arithmetic of snake.py's kernel
            alpha = tl.load(alpha_ptr + channel).to(tl.float32)
            wave = tl.sin(alpha * acc)
            acc = acc + (1.0 / (alpha + 1e-9)) * (wave * wave)
        tl.store(out_ptr + row.to(tl.int64) * length + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
