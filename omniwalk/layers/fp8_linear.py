"""FP8 (e4m3) linear layers: weights quantized once per output channel, activations per
token at run time (W8A8, dynamic), as `--quantization fp8`:

    x_scale[m] = max_k |x[m, k]| / 448            w_scale[n] = max_k |W[n, k]| / 448
    xq = fp8(x / x_scale)                         Wq = fp8(W / w_scale)
    y[m, n] = (sum_k xq[m, k] * Wq[n, k]) * x_scale[m] * w_scale[n]      (fp32 sums, bf16 out)

A decoder's projections (q/k/v, o, gate/up, down) are swapped for `Fp8Linear` after the
weights load; the embeddings and the LM head keep the model dtype. On a GPU with FP8
tensor cores (sm_89+) the product is one `torch._scaled_mm` and the activation
quantization one Triton kernel: half the weight bytes of bf16 and about twice its peak
FLOPs, which is what a large decode batch and a prefill wave are bound by. Elsewhere the
same quantized values are multiplied in fp32 (the path CI runs). Outputs differ from the
bf16 model by the quantization error: greedy ids are not expected to match transformers.

Where the op before a projection is a fused kernel of ours (the RMSNorms before q/k/v and
gate/up, the SiLU-mul before down), it writes the FP8 rows and their scales itself
(`Fp8Rows`, `fuse_input_quantization`): the same values bit for bit, one kernel and one
bf16 round trip through memory fewer per projection (three of the four in a layer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the torch path needs no Triton
    triton = None

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max            # 448
MIN_SCALE = 1e-12                               # an all-zero row quantizes to zeros, not NaN
# the decoder projections `quantize_linear_layers` swaps (the HF names of the packed modules)
QUANTIZED_PROJECTIONS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores (`torch._scaled_mm`): sm_89 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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


class Fp8Linear(nn.Module):
    """An `nn.Linear` with its weight in FP8, one scale per output channel (see module doc)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight, scale = quantize_rows_reference(linear.weight)
        # buffers, not parameters: nothing trains them, and checkpoint loading is done by now
        self.register_buffer("weight", weight)                      # [out, in] fp8, row-major
        self.register_buffer("weight_scale", scale.reshape(1, -1))  # [1, out] fp32
        self.bias = linear.bias
        self.use_scaled_mm = fp8_supported(weight.device)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:   # x: [..., in] -> [..., out]
        shape = x.shape
        if isinstance(x, Fp8Rows):
            x_quantized, x_scale, dtype = x.values, x.scale, x.dtype
        else:
            (x_quantized, x_scale), dtype = quantize_rows(x.reshape(-1, self.in_features)), x.dtype
        if self.use_scaled_mm:
            # weight.t() is column-major, as _scaled_mm wants its second operand
            y = torch._scaled_mm(x_quantized, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale,
                                 out_dtype=dtype)
        else:
            y = ((x_quantized.float() @ self.weight.float().t()) * x_scale * self.weight_scale).to(dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, per-channel scales"


def quantize_linear_layers(model: nn.Module, names: frozenset[str] = QUANTIZED_PROJECTIONS) -> int:
    """Swaps every `nn.Linear` child called one of `names` for an `Fp8Linear` of its
    weights, in place; returns how many. Layers whose sizes `_scaled_mm` cannot take
    (not multiples of 16) stay as they are."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name not in names or not isinstance(child, nn.Linear):
                continue
            if child.in_features % 16 or child.out_features % 16:
                logger.warning("%s (%d -> %d) stays unquantized: FP8 GEMMs need multiples of 16",
                               name, child.in_features, child.out_features)
                continue
            setattr(module, name, Fp8Linear(child))
            swapped += 1
    return swapped


def fuse_input_quantization(model: nn.Module) -> int:
    """Lets each module that feeds an `Fp8Linear` alone quantize its output itself; returns
    how many. A module lists such pairs in `fp8_input_producers` (producer's path ->
    projection's path, "" for itself); a producer quantizes when its `quantize_output` is
    set, and hands the projection `Fp8Rows`."""
    fused = 0
    for module in model.modules():
        for producer, consumer in getattr(module, "fp8_input_producers", {}).items():
            if isinstance(module.get_submodule(consumer), Fp8Linear):
                module.get_submodule(producer).quantize_output = True
                fused += 1
    return fused
