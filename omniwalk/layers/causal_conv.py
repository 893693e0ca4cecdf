"""Short causal depthwise convolution with a carried state (Gated DeltaNet, Mamba).

Each channel is convolved over time with its own `kernel_size` taps, seeing only the
present and past inputs. A sequence computed in pieces (prefill chunks, then one decode
step at a time) carries the last `kernel_size - 1` inputs from one piece to the next:

    state (K-1 = 3)      new inputs x0 x1
    [ s0  s1  s2 ] [ x0  x1 ]             y0 = w . [s0 s1 s2 x0]
                                          y1 = w . [s1 s2 x0 x1]
    next state:  [ s2  x0  x1 ]

A fresh sequence starts from a zero state, which is the zero left padding of a plain
causal convolution. CPU reference in torch; the GPU kernels come with the fla-core step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,          # [batch, seq_len, channels]: new inputs of `batch` sequences of equal length
    weight: torch.Tensor,     # [channels, kernel_size]
    state: torch.Tensor,      # [batch, channels, kernel_size - 1]: the inputs before x
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the outputs [batch, seq_len, channels] and the new state (same shape as `state`).

    Computes in the weight's dtype and returns the input's, as transformers does."""
    channels = x.shape[2]
    window = torch.cat([state.to(weight.dtype), x.transpose(1, 2).to(weight.dtype)], dim=-1)
    out = F.conv1d(window, weight.unsqueeze(1), groups=channels)    # [batch, channels, seq_len]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    new_state = window[:, :, window.shape[-1] - state.shape[-1]:].to(state.dtype)
    return out.transpose(1, 2).to(x.dtype), new_state
