"""FP8 (e4m3) row quantization, as `--quantization fp8` quantizes activations (and, once,
the weights: `omniwalk.layers.fp8_linear`):

    scale[m] = max_k |x[m, k]| / 448            xq = fp8(x / scale)

`quantize_rows_reference` is the torch version (the CPU path); `quantize_rows` one Triton
kernel on CUDA (one program per row). `quantize_block` is the same arithmetic on a row held
in registers: every kernel that writes `Fp8Rows` (the fused norms, the SiLU-mul) calls it,
so they agree with `quantize_rows` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniwalk.kernels.triton_support import triton

if triton is not None:
    import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max            # 448
MIN_SCALE = 1e-12                               # an all-zero row quantizes to zeros, not NaN


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 scales [M, 1]): each row scaled so its largest
    magnitude maps to 448, then rounded to nearest (even)."""
    x = x.float()
    # times the fp32 reciprocal, as CUDA torch divides by a scalar (and the kernel does)
    scale = (x.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference`, one Triton kernel on CUDA (one program per row)."""
    if triton is None or not x.is_cuda:
        return quantize_rows_reference(x)
    return _launch_quantize_rows(x)


def _launch_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(width)
    _quantize_rows_kernel[(rows,)](x, out, scale, x.stride(0), width, FP8_MAX, 1.0 / FP8_MAX, MIN_SCALE, BLOCK=block,
                                   num_warps=max(1, min(16, block // 512)))
    return out, scale


if triton is not None:
    @triton.jit
    def quantize_block(x, fp8_max, inverse_fp8_max, min_scale):
        """(fp8 values, scale) of one row held in registers (fp32, padding 0): the
        reference's arithmetic exactly (an IEEE division where torch divides two tensors).
        Shared by every kernel that writes `Fp8Rows`, so they agree bit for bit."""
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inverse_fp8_max, min_scale)
        quantized = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        return quantized.to(tl.float8e4nv), scale

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, width, fp8_max, inverse_fp8_max, min_scale,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)   # rows x width may pass 2^31 in a long prefill
        offsets = tl.arange(0, BLOCK)
        mask = offsets < width
        x = tl.load(x_ptr + row * stride_x + offsets, mask=mask, other=0.0).to(tl.float32)
        quantized, scale = quantize_block(x, fp8_max, inverse_fp8_max, min_scale)
        tl.store(out_ptr + row * width + offsets, quantized, mask=mask)
        tl.store(scale_ptr + row, scale)


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already quantized per row by the kernel that produced them (a norm or a
    SiLU-mul fused with `quantize_rows`), as an `Fp8Linear` takes them."""

    values: torch.Tensor    # [M, K] fp8 e4m3
    scale: torch.Tensor     # [M, 1] fp32
    dtype: torch.dtype      # the activations' dtype: the projection's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @classmethod
    def of(cls, x: torch.Tensor) -> "Fp8Rows":
        """`quantize_rows` of x [..., K] (the unfused path: CPU, or a producer without a kernel)."""
        return cls(*quantize_rows(x.reshape(-1, x.shape[-1])), x.dtype)
