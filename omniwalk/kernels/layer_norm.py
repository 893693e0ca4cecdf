"""LayerNorm with the residual add fused in, for the GPU decode path (Whisper's decoder),
with the torch reference beside it.

A Whisper decode step at one row is ~650 kernels, each costing its launch more than its
bytes: a layer's three norms and three residual adds are six of them. Here each add goes
into the next norm (`add_layer_norm`): one Triton kernel on CUDA (PDL inside a graph),
plain torch elsewhere. Rounding as torch's: the add rounded to the activation dtype, mean
and variance of the rounded sum in fp32, (x - mean) * rstd * weight + bias in fp32, one
rounding at the end.

CI runs the kernel in Triton's interpreter against the torch version
(tests/kernels/test_layer_norm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.triton_support import pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.triton_support import await_predecessor


def add_layer_norm(x: torch.Tensor | None, residual: torch.Tensor, norm: torch.nn.LayerNorm
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) over the last dim of [rows, width] tensors; x None:
    (norm(residual), residual)."""
    if not use_triton(residual):
        summed = residual if x is None else x + residual
        return norm(summed), summed
    rows, width = residual.shape
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    summed = residual if x is None else torch.empty_like(residual)
    _add_layer_norm_kernel[(rows,)](
        residual if x is None else x.contiguous(), residual, norm.weight, norm.bias, out, summed, norm.eps, width,
        HAS_X=x is not None, BLOCK=triton.next_power_of_2(width), **pdl_launch(residual))
    return out, summed


if triton is not None:

    @triton.jit
    def _add_layer_norm_kernel(x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, summed_ptr, eps, width,
                               HAS_X: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)   # nobody writes them: before the wait
        b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        await_predecessor(PDL)
        h = tl.load(residual_ptr + row * width + cols, mask=mask, other=0.0)
        if HAS_X:
            x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0)
            h = (x.to(tl.float32) + h.to(tl.float32)).to(h.dtype)   # rounded like a torch add
            tl.store(summed_ptr + row * width + cols, h, mask=mask)
        hf = h.to(tl.float32)
        mean = tl.sum(hf, axis=0) / width
        centered = tl.where(mask, hf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / width + eps)
        tl.store(out_ptr + row * width + cols, (centered * rstd * w + b).to(h.dtype), mask=mask)
