"""RMS norms for the GPU decode path (plain, zero-centered, with the residual add fused in,
gated), with the torch reference beside them.

A decode step of a small model is dominated by kernel count, not FLOPs: unfused, one
RMSNorm is six kernels. Each op here is one Triton kernel on CUDA and plain torch
elsewhere, and both round exactly where transformers rounds in bf16 (normalize in fp32,
cast, then scale), so the GPU path stays bit-close to the reference and the CPU path is
the reference (`rms_norm_reference`).

CI runs the kernels in Triton's interpreter against the torch versions
(tests/kernels/test_rms_norm.py).

`quantize=True`: the norm's output goes on to an FP8 projection, so the kernel quantizes
its rows as `fp8.quantize_rows` does and returns `Fp8Rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Rows
from omniwalk.kernels.fused_moe import ExpertRows
from omniwalk.kernels.triton_support import pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.fp8 import quantize_block
    from omniwalk.kernels.triton_support import await_predecessor


# ----------------------------------------------------------------------------- reference

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:   # scale by 1 + weight in fp32, cast last (Qwen3.5, Gemma)
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


# ----------------------------------------------------------------------------- public ops

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
             quantize: bool = False) -> torch.Tensor | Fp8Rows:
    """RMSNorm over the last dim (any leading shape); `zero_centered`: scale by 1 + weight."""
    if isinstance(x, ExpertRows):
        x = x.sum()
    if not use_triton(x):
        normed = rms_norm_reference(x, weight, eps, zero_centered)
        return Fp8Rows.of(normed) if quantize else normed
    return _launch_norm(x, None, weight, eps, zero_centered, quantize)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False, quantize: bool = False):
    """(norm(x + residual), x + residual): the residual add fused into the next norm. `x`
    may be a MoE block's ExpertRows [T, k, H]: on CUDA the kernel sums them first, in fp32
    and in order, then rounds, as `sum_pairs` does."""
    if isinstance(x, ExpertRows):
        if use_triton(residual):
            return _launch_norm(x.rows, residual, weight, eps, zero_centered, quantize, parts=x.rows.shape[1])
        x = x.sum()
    if not use_triton(x):
        summed = x + residual
        normed = rms_norm_reference(summed, weight, eps, zero_centered)
        return (Fp8Rows.of(normed) if quantize else normed), summed
    return _launch_norm(x, residual, weight, eps, zero_centered, quantize)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x) * silu(gate)` per head, x and gate [tokens, heads, dim] (Gated DeltaNet's
    output norm), with
    transformers' casts: the norm as `rms_norm`, the gate and product in fp32, cast last."""
    if not use_triton(x):
        return (rms_norm_reference(x, weight, eps) * F.silu(gate.float())).to(x.dtype)
    # x, gate: [tokens, heads, dim]; the gate may be a strided view of a packed projection
    tokens, heads, width = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _gated_rms_norm_kernel[(tokens * heads,)](
        x, gate, weight, out, heads, gate.stride(0), gate.stride(1), eps, width,
        BLOCK=triton.next_power_of_2(width), **pdl_launch(x))
    return out


def _launch_norm(x, residual, weight, eps, zero_centered=False, quantize=False, parts=1):
    # parts > 1: x is [rows, parts, width], each row the sum of its parts
    shape = x.shape if parts == 1 else residual.shape
    x2 = x.reshape(-1, shape[-1]) if parts == 1 else x
    rows, width = x2.shape[0], shape[-1]
    out = torch.empty((rows, width), dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quantize else out
    residual2 = residual.reshape(-1, shape[-1]) if residual is not None else x2
    residual_out = torch.empty((rows, width), dtype=x.dtype, device=x.device) if residual is not None else x2
    _add_rms_norm_kernel[(rows,)](
        x2, residual2, weight, out, residual_out, scale,
        x2.stride(0), x2.stride(1) if parts > 1 else 0, residual2.stride(0), eps, width, FP8_MAX, 1.0 / FP8_MAX,
        MIN_SCALE, HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, QUANTIZE=quantize, PARTS=parts,
        BLOCK=triton.next_power_of_2(width), **pdl_launch(x),
    )
    normed = Fp8Rows(out, scale, x.dtype) if quantize else out.view(shape)
    return normed, (residual_out.view(shape) if residual is not None else None)


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def scale_normed(normed, w, dtype: tl.constexpr, ZERO_CENTERED: tl.constexpr):
        """The weight step of an RMSNorm, rounded where transformers rounds (normed, w: fp32).
        Shared with the QK-norm of `norm_rotary`."""
        if ZERO_CENTERED:
            return (normed * (1.0 + w)).to(dtype)
        return (w * normed.to(dtype).to(tl.float32)).to(dtype)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                             stride_x, stride_part, stride_residual, eps, width, fp8_max, inverse_fp8_max, min_scale,
                             HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, QUANTIZE: tl.constexpr,
                             PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)   # nobody writes it: before the wait
        await_predecessor(PDL)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if PARTS > 1:   # a MoE block's k weighted rows: summed in fp32, in order, then rounded
            total = x.to(tl.float32)
            for part in tl.static_range(1, PARTS):
                total += tl.load(x_ptr + row * stride_x + part * stride_part + cols, mask=mask, other=0.0).to(tl.float32)
            x = total.to(x.dtype)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)   # rounded like a torch add
            tl.store(residual_out_ptr + row * width + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / width + eps)
        normed = scale_normed(xf * inv, w, x.dtype, ZERO_CENTERED)
        if QUANTIZE:   # quantize_rows of the normed row, as if it had gone through memory
            quantized, scale = quantize_block(normed.to(tl.float32), fp8_max, inverse_fp8_max, min_scale)
            tl.store(out_ptr + row * width + cols, quantized, mask=mask)
            tl.store(scale_ptr + row, scale)
        else:
            tl.store(out_ptr + row * width + cols, normed, mask=mask)

    @triton.jit
    def _gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, heads, stride_gate_token, stride_gate_head,
                               eps, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_predecessor(PDL)
        row = tl.program_id(0)   # token * heads + head
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / width + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        normed = scale_normed(xf * inv, w, x.dtype, False).to(tl.float32)
        gate_row = gate_ptr + (row // heads) * stride_gate_token + (row % heads) * stride_gate_head
        g = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (normed * (g / (1.0 + tl.exp(-g)))).to(x.dtype), mask=mask)
