"""FP8 (e4m3) linear layers: weights quantized once per output channel, activations per
token at run time (W8A8, dynamic), as `--quantization fp8`:

    x_scale[m] = max_k |x[m, k]| / 448            w_scale[n] = max_k |W[n, k]| / 448
    xq = fp8(x / x_scale)                         Wq = fp8(W / w_scale)
    y[m, n] = (sum_k xq[m, k] * Wq[n, k]) * x_scale[m] * w_scale[n]      (fp32 sums, bf16 out)

A decoder's projections (q/k/v, o, gate/up, down) are swapped for `Fp8Linear` after the
weights load; the embeddings and the LM head keep the model dtype. On a GPU with FP8
tensor cores (sm_89+) the product is one `torch._scaled_mm` and the activation
quantization one Triton kernel (`omniwalk.kernels.fp8`): half the weight bytes of bf16
and about twice its peak FLOPs, which is what a large decode batch and a prefill wave are
bound by. Elsewhere the same quantized values are multiplied in fp32 (the path CI runs). Outputs differ from the
bf16 model by the quantization error: greedy ids are not expected to match transformers.

Where the op before a projection is a fused kernel of ours (the RMSNorms before q/k/v and
gate/up, the SiLU-mul before down), it writes the FP8 rows and their scales itself
(`Fp8Rows`, `fuse_input_quantization`): the same values bit for bit, one kernel and one
bf16 round trip through memory fewer per projection (three of the four in a layer).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from omniwalk.kernels.fp8 import Fp8Rows, quantize_rows, quantize_rows_reference

logger = logging.getLogger(__name__)

# the decoder projections `quantize_linear_layers` swaps (the HF names of the packed modules)
QUANTIZED_PROJECTIONS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores (`torch._scaled_mm`): sm_89 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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
