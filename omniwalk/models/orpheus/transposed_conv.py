"""SNAC's upsampling step, Snake then a transposed convolution by `rate`, as one Triton kernel.

cuDNN runs these convolutions as "dgrad" kernels on NHWC copies of the activations: at
256 streams on the H200 one of SNAC's four took ~1 ms per 64 windows, and the layout
transposes around them more. With kernel size 2 * rate (SNAC's), every output step t
sums exactly two input steps: writing t + padding = q * rate + r,

    out[b, o, t] = bias[o] + sum_i W[i, o, r] * s(x)[b, i, q] + W[i, o, r + rate] * s(x)[b, i, q - 1]

with s = Snake and x zero outside [0, length). For one phase r that is a GEMM over the
input channels of both taps; its columns are (window, q) pairs, so a program's weight
tile serves several windows. Snake is applied to the input tile in registers. The product
runs on tensor cores in TF32 when cuDNN's convolutions may (`torch.backends.cudnn.allow_tf32`),
else in full fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.layers.fused_ops import triton, use_triton
from omniwalk.models.orpheus.snake import snake_reference

if triton is not None:
    import triton.language as tl


def snake_conv_transpose_reference(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None, rate: int, padding: int,
                                   output_padding: int) -> torch.Tensor:
    return F.conv_transpose1d(snake_reference(x, alpha), weight, bias, rate, padding, output_padding)


def snake_conv_transpose(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         rate: int, padding: int, output_padding: int, taps_first: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """x [B, I, L], alpha [1, I, 1], weight [I, O, 2 * rate] -> conv_transpose1d(snake(x)),
    [B, O, L * rate] for SNAC's padding (ceil(rate / 2)) and output padding (rate % 2).
    `taps_first`: the weight as [2 * rate, O, I] contiguous, if the caller keeps it."""
    if not use_triton(x):
        return snake_conv_transpose_reference(x, alpha, weight, bias, rate, padding, output_padding)
    batch, channels_in, length = x.shape
    channels_out, taps = weight.shape[1], weight.shape[2]
    if taps != 2 * rate:
        raise ValueError(f"the kernel needs kernel_size == 2 * stride, got {taps} and {rate}")
    length_out = (length - 1) * rate - 2 * padding + taps + output_padding
    x = x.contiguous()
    if taps_first is None:
        taps_first = weight.permute(2, 1, 0).contiguous()
    out = torch.empty(batch, channels_out, length_out, dtype=x.dtype, device=x.device)
    columns = batch * (length + 1)    # q in [0, length]: q = length reaches the last outputs
    block_o = max(16, min(64, triton.next_power_of_2(channels_out)))
    block_i = max(16, min(32, triton.next_power_of_2(channels_in)))
    block_n = 64
    grid = (triton.cdiv(columns, block_n), triton.cdiv(channels_out, block_o), rate)
    _snake_conv_transpose_kernel[grid](
        x, alpha, taps_first, bias if bias is not None else alpha, out,
        channels_in, channels_out, length, length_out, columns, rate, padding,
        HAS_BIAS=bias is not None, TF32=torch.backends.cudnn.allow_tf32,
        BLOCK_O=block_o, BLOCK_N=block_n, BLOCK_I=block_i)
    return out


if triton is not None:

    @triton.jit
    def _snake_conv_transpose_kernel(x_ptr, alpha_ptr, weight_ptr, bias_ptr, out_ptr,
                                     channels_in, channels_out, length, length_out, columns, rate, padding,
                                     HAS_BIAS: tl.constexpr, TF32: tl.constexpr,
                                     BLOCK_O: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)   # (window, q) pairs
        outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        phase = tl.program_id(2)                                     # r
        col_ok, out_ok = cols < columns, outs < channels_out
        window = (cols // (length + 1)).to(tl.int64)
        q = cols % (length + 1)
        now_ok = col_ok & (q < length)            # x[q] exists
        before_ok = col_ok & (q >= 1)             # x[q - 1] exists
        acc = tl.zeros([BLOCK_O, BLOCK_N], dtype=tl.float32)
        for start in range(0, channels_in, BLOCK_I):
            ins = start + tl.arange(0, BLOCK_I)
            in_ok = ins < channels_in
            alpha = tl.load(alpha_ptr + ins, mask=in_ok, other=1.0)[:, None]
            inv_alpha = 1.0 / (alpha + 1e-9)
            base = x_ptr + (window[None, :] * channels_in + ins[:, None]) * length + q[None, :]
            x_now = tl.load(base, mask=in_ok[:, None] & now_ok[None, :], other=0.0)
            x_before = tl.load(base - 1, mask=in_ok[:, None] & before_ok[None, :], other=0.0)
            wave = tl.sin(alpha * x_now)
            x_now = x_now + inv_alpha * (wave * wave)        # Snake (0 stays 0 outside)
            wave = tl.sin(alpha * x_before)
            x_before = x_before + inv_alpha * (wave * wave)
            w_at = outs[:, None] * channels_in + ins[None, :]
            w_mask = out_ok[:, None] & in_ok[None, :]
            w_now = tl.load(weight_ptr + phase * channels_out * channels_in + w_at, mask=w_mask, other=0.0)
            w_before = tl.load(weight_ptr + (phase + rate) * channels_out * channels_in + w_at, mask=w_mask,
                               other=0.0)
            if TF32:
                acc = tl.dot(w_now, x_now, acc, input_precision="tf32")
                acc = tl.dot(w_before, x_before, acc, input_precision="tf32")
            else:
                acc = tl.dot(w_now, x_now, acc, input_precision="ieee")
                acc = tl.dot(w_before, x_before, acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + outs, mask=out_ok, other=0.0)[:, None]
        t = q * rate + phase - padding
        t_ok = col_ok & (t >= 0) & (t < length_out)
        at = (window[None, :] * channels_out + outs[:, None]) * length_out + t[None, :]
        tl.store(out_ptr + at, acc, mask=out_ok[:, None] & t_ok[None, :])
