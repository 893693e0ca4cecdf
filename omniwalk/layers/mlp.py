"""Gated SiLU MLP (SwiGLU), as in Llama and Qwen3."""

from __future__ import annotations

import torch
from torch import nn

from omniwalk.kernels.silu_mul import silu_and_mul
from omniwalk.engine.tensor_parallel import tensor_parallel_group
from omniwalk.layers.parallel import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    quantize_output = False   # of the SiLU-mul: set when down_proj is FP8 (fp8_linear.fuse_input_quantization)
    fp8_input_producers = {"": "down_proj"}

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        # gate and up in one projection (loaded from gate_proj/up_proj); under tensor
        # parallelism each rank holds matching gate and up rows, and down_proj sums the ranks'
        self.intermediate_size = intermediate_size // tensor_parallel_group().size   # this rank's rows
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (intermediate_size, intermediate_size), bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.packed_projections = {
            "gate_proj": ("gate_up_proj", 0, intermediate_size),
            "up_proj": ("gate_up_proj", intermediate_size, 2 * intermediate_size),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(silu_and_mul(gate, up, quantize=self.quantize_output))
