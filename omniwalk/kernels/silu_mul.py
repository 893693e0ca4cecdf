"""The gated MLP's `silu(gate) * up` as one Triton kernel on CUDA, torch elsewhere (the
reference: `F.silu(gate) * up`).

The kernel rounds where torch does in bf16 (the SiLU, then the product, each cast to the
activation dtype). `quantize=True`: the product goes on to an FP8 `down_proj`, so the
kernel quantizes its rows as `fp8.quantize_rows` does and returns `Fp8Rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, Fp8Rows
from omniwalk.kernels.triton_support import pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.triton_support import await_predecessor

    from omniwalk.kernels.fp8 import quantize_block


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, quantize: bool = False) -> torch.Tensor | Fp8Rows:
    if not use_triton(gate):
        out = F.silu(gate) * up
        return Fp8Rows.of(out) if quantize else out
    gate2, up2 = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    rows, width = gate2.shape
    if quantize:   # the row's scale needs all of it: one program per row
        out = torch.empty((rows, width), dtype=FP8_DTYPE, device=gate.device)
        scale = torch.empty((rows, 1), dtype=torch.float32, device=gate.device)
        block = triton.next_power_of_2(width)
        _silu_mul_kernel[(rows, 1)](gate2, up2, out, gate2.stride(0), up2.stride(0), width, scale,
                                    FP8_MAX, 1.0 / FP8_MAX, MIN_SCALE, BLOCK=block, QUANTIZE=True, **pdl_launch(gate),
                                    num_warps=max(4, min(16, block // 512)))
        return Fp8Rows(out, scale, gate.dtype)
    out = torch.empty_like(gate)
    out2 = out.view(-1, gate.shape[-1])
    block = min(4096, triton.next_power_of_2(width))
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](
        gate2, up2, out2, gate2.stride(0), up2.stride(0), width, out2, 0.0, 0.0, 0.0, BLOCK=block, QUANTIZE=False,
        **pdl_launch(gate))
    return out


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, width,
                         scale_ptr, fp8_max, inverse_fp8_max, min_scale, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr,
                         PDL: tl.constexpr):
        await_predecessor(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
        u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        product = (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        if QUANTIZE:   # one program holds the whole row (BLOCK >= width)
            quantized, scale = quantize_block(product.to(tl.float32), fp8_max, inverse_fp8_max, min_scale)
            tl.store(out_ptr + row * width + cols, quantized, mask=mask)
            tl.store(scale_ptr + row, scale)
        else:
            tl.store(out_ptr + row * width + cols, product, mask=mask)
