"""RMS norms, computed exactly as Hugging Face does for each family: plain (Llama, Qwen3),
zero-centered (`1 + weight`: Qwen3.5, Gemma) and gated (Gated DeltaNet outputs)."""

from __future__ import annotations

import torch
from torch import nn

from omniwalk.kernels.rms_norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    init_weight = 1.0   # the neutral weight, for `init_random_weights`
    quantize_output = False   # set when an FP8 projection alone reads it (fp8_linear.fuse_input_quantization)

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        # Normalize in fp32, cast back to the input dtype, and only then scale by the
        # weight: the order matters for bit-parity with transformers in bf16.
        return rms_norm(x, self.weight, self.eps, quantize=self.quantize_output)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), one kernel on CUDA."""
        return add_rms_norm(x, residual, self.weight, self.eps, quantize=self.quantize_output)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose scale is `1 + weight` (Gemma, Qwen3-Next, Qwen3.5): checkpoints store
    the offset from one, so a freshly initialized weight is zero.

    Unlike `RMSNorm` it scales in fp32 and casts last, as transformers does for these models.
    """

    init_weight = 0.0   # the neutral weight, for `init_random_weights`
    quantize_output = False   # as RMSNorm's

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        return rms_norm(x, self.weight, self.eps, zero_centered=True, quantize=self.quantize_output)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), one kernel on CUDA."""
        return add_rms_norm(x, residual, self.weight, self.eps, zero_centered=True,
                            quantize=self.quantize_output)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """RMSNorm followed by a SiLU gate, `norm(x) * silu(gate)` (the output norm of Gated
    DeltaNet), with transformers' casts: normalize in fp32, scale in the input dtype,
    gate in fp32, cast back."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # x, gate: [..., dim]
        return gated_rms_norm(x, gate, self.weight, self.eps)
