"""`attention_of_changing_shapes`: scaled_dot_product_attention for attention whose shapes
change from call to call (Code2Wav's chunks, the audio encoder's segments), without
cuDNN's backend.

On the H200 torch picks cuDNN's attention first, and cuDNN builds an execution plan on the
host for each new problem: in serving, Code2Wav's batch-8 chunk spent 132 ms of host time
in 8 `_cudnn_attention_forward` calls (16.5 ms each) for 0.24 ms of GPU work, 183 ms a
chunk against 23 ms for the same chunks decoded alone. Flash and memory-efficient
attention launch without a plan. Attention of fixed shapes (decode steps, graphs) keeps
torch's choice. The backend flags are process-wide while the context is open: only the
engine loop's thread runs models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_PLANLESS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_of_changing_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, **kwargs)` on any backend but cuDNN's."""
    with sdpa_kernel(_PLANLESS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
