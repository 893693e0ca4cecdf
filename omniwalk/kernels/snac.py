"""SNAC's decoder ops as Triton kernels (CUDA), each with its torch reference beside it: the
Snake activation, the depthwise dilated convolutions (with the next Snake fused in), and
the 1x1 convolutions with what follows them. The modules that call them:
`omniwalk.models.orpheus.snac`.

Snake, x + sin^2(alpha x) / alpha per channel (`snake`; reference `snake_reference`), and
SnakeBeta, x + sin^2(alpha x) / beta (Qwen3-Omni's Code2Wav: 27 of them, up to [B, 96, 49920]
at a 26-frame chunk; torch's five passes were half the CUDA time of a batch-32 chunk on the
H200, 34 of 68 ms). In
torch it is five passes over the activations (alpha * x and the final product are
broadcasts over [B, C, T], which PyTorch runs in its slower non-vectorized elementwise
kernel), and SNAC's decoder applies it 29 times: at 256 streams on the H200 these passes
were ~40% of the CUDA time of a decoding step. One kernel reads x once and writes once,
in fp32 arithmetic in the torch order (up to a fused multiply-add in the last step).

Depthwise (one filter per channel) 7-tap convolutions (`depthwise_conv1d`; reference
`depthwise_conv1d_reference`, what `nn.Conv1d(groups=channels)` computes). PyTorch runs a
depthwise `Conv1d` in fp32 through its generic native kernel
(`conv_depthwise2d_forward_kernel_generic`), which at 256 streams on the H200 was the
largest single item of a decoding step's CUDA time (~1.8 ms of ~12). Each output is
seven multiply-adds over a dilated window, so the kernel reads the input once per tap
from cache and writes once; the sum is in fp32 in tap order (not cuDNN's order: results
agree to float rounding).

1x1 convolutions with what follows them fused in (`pointwise_conv`; reference
`pointwise_conv_reference`): one kernel computes

    out = residual + scale * (W @ y + bias)        per row b, over channels, at every step t
    (residual, scale and bias each optional: SNAC's short transposed convs use W @ y alone)

    residual unit:    x + conv1x1(snake(dwconv(snake(x))))      residual = x, no scale
    noise injection:  x + noise * conv1x1(x)                    residual = y = x, scale = noise[b, t]

In torch that is a convolution writing W @ y, then one or two more passes over the
activations (the multiply by the noise, the residual add); at 256 streams on the H200
those adds alone were ~10% of a decoding step's CUDA time. Here the product stays in
registers and the epilogue adds in the torch order (bias, then scale, then residual).
The product runs on tensor cores in TF32 when cuDNN's convolutions may
(`torch.backends.cudnn.allow_tf32`, on by default), else in full fp32.
"""

from __future__ import annotations

import torch

from omniwalk.kernels.triton_support import triton, use_triton

if triton is not None:
    import triton.language as tl


# ----------------------------------------------------------------------------- Snake

def snake_reference(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], alpha [1, C, 1] -> x + sin(alpha x)^2 / (alpha + 1e-9), as `snac` computes it."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def snake_beta_reference(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], alpha and beta [1, C, 1] -> x + sin(x alpha)^2 / (beta + 1e-9): SnakeBeta
    (Qwen3-Omni's Code2Wav), the op order of transformers' `SnakeBeta`."""
    return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


def snake(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None = None) -> torch.Tensor:
    """Snake (`snake_reference`), or SnakeBeta with `beta` (`snake_beta_reference`): one pass."""
    if not use_triton(x):
        return snake_reference(x, alpha) if beta is None else snake_beta_reference(x, alpha, beta)
    batch, channels, length = x.shape
    if x.stride(2) != 1 or x.stride(0) != channels * x.stride(1):
        x = x.contiguous()   # rows may be longer than `length` (a causal conv's padded output, cropped)
    out = torch.empty((batch, channels, length), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(length))
    _snake_kernel[(batch * channels, triton.cdiv(length, block))](
        x, alpha, alpha if beta is None else beta, out, channels, length, x.stride(1), BLOCK=block)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["length", "stride_row"])
    def _snake_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, channels, length, stride_row, BLOCK: tl.constexpr):
        row = tl.program_id(0)                     # batch * channels + channel
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < length
        alpha = tl.load(alpha_ptr + row % channels).to(tl.float32)
        beta = tl.load(beta_ptr + row % channels).to(tl.float32)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        wave = tl.sin(alpha * x)
        out = x + (1.0 / (beta + 1e-9)) * (wave * wave)
        tl.store(out_ptr + row.to(tl.int64) * length + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- depthwise conv

def depthwise_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
                               padding: int, snake_alpha: torch.Tensor | None = None) -> torch.Tensor:
    """`depthwise_conv1d` in torch: the convolution `nn.Conv1d(groups=channels)` runs (the CPU
    path of `DepthwiseConv1d`), then `snake_reference` if `snake_alpha` is given."""
    out = torch.nn.functional.conv1d(x, weight, bias, padding=padding, dilation=dilation, groups=x.shape[1])
    return out if snake_alpha is None else snake_reference(out, snake_alpha)


def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
                     padding: int, snake_alpha: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T], weight [C, 1, K] -> [B, C, T] (stride 1, zero padding, same length).
    `snake_alpha` [1, C, 1]: Snake applied to the result in the same pass (as `snake`)."""
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
        if SNAKE:   # the arithmetic of _snake_kernel
            alpha = tl.load(alpha_ptr + channel).to(tl.float32)
            wave = tl.sin(alpha * acc)
            acc = acc + (1.0 / (alpha + 1e-9)) * (wave * wave)
        tl.store(out_ptr + row.to(tl.int64) * length + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- 1x1 conv

def pointwise_conv_reference(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             residual: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    product = torch.nn.functional.conv1d(y, weight, bias)
    return residual + (product if scale is None else scale * product)


def pointwise_conv(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [B, I, T], weight [O, I, 1], bias [O] or None, residual [B, O, T] or None, scale
    [B, 1, T] or None -> residual + scale * (conv1x1(y) + bias), [B, O, T]."""
    if not use_triton(y):
        if residual is None:
            return torch.nn.functional.conv1d(y, weight, bias) * (1 if scale is None else scale)
        return pointwise_conv_reference(y, weight, bias, residual, scale)
    batch, channels_in, length = y.shape
    channels_out = weight.shape[0]
    y = y.contiguous()
    residual = residual.contiguous() if residual is not None else None
    scale = scale.contiguous() if scale is not None else None
    weight = weight.reshape(channels_out, channels_in).contiguous()
    out = torch.empty(batch, channels_out, length, dtype=y.dtype, device=y.device)
    # tl.dot wants powers of two of at least 16 on each side
    block_o = max(16, min(32, triton.next_power_of_2(channels_out)))   # 32 x 128 x 32: fastest at
    # every snac_24khz block shape (a sweep at 78d31df: benchmarks/scripts/pointwise_conv_sweep.py; docs/benchmarks.md)
    block_i = max(16, min(32, triton.next_power_of_2(channels_in)))
    block_t = 128
    grid = (triton.cdiv(length, block_t), triton.cdiv(channels_out, block_o), batch)
    _pointwise_conv_kernel[grid](
        y, weight, bias if bias is not None else weight, residual if residual is not None else y,
        scale if scale is not None else y, out, channels_in, channels_out, length,
        scale.stride(0) if scale is not None else 0, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        HAS_RESIDUAL=residual is not None, TF32=torch.backends.cudnn.allow_tf32,
        BLOCK_O=block_o, BLOCK_T=block_t, BLOCK_I=block_i)
    return out


if triton is not None:

    @triton.jit
    def _pointwise_conv_kernel(y_ptr, weight_ptr, bias_ptr, residual_ptr, scale_ptr, out_ptr,
                               channels_in, channels_out, length, stride_scale,
                               HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                               TF32: tl.constexpr,
                               BLOCK_O: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
        steps = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        row = tl.program_id(2).to(tl.int64)
        step_ok, out_ok = steps < length, outs < channels_out
        acc = tl.zeros([BLOCK_O, BLOCK_T], dtype=tl.float32)
        for start in range(0, channels_in, BLOCK_I):
            ins = start + tl.arange(0, BLOCK_I)
            in_ok = ins < channels_in
            w = tl.load(weight_ptr + outs[:, None] * channels_in + ins[None, :],
                        mask=out_ok[:, None] & in_ok[None, :], other=0.0)
            y = tl.load(y_ptr + (row * channels_in + ins[:, None]) * length + steps[None, :],
                        mask=in_ok[:, None] & step_ok[None, :], other=0.0)
            if TF32:
                acc = tl.dot(w, y, acc, input_precision="tf32")
            else:
                acc = tl.dot(w, y, acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + outs, mask=out_ok, other=0.0)[:, None]
        if HAS_SCALE:
            acc = tl.load(scale_ptr + row * stride_scale + steps, mask=step_ok, other=0.0)[None, :] * acc
        at = (row * channels_out + outs[:, None]) * length + steps[None, :]
        mask = out_ok[:, None] & step_ok[None, :]
        if HAS_RESIDUAL:
            acc = tl.load(residual_ptr + at, mask=mask, other=0.0) + acc
        tl.store(out_ptr + at, acc, mask=mask)
