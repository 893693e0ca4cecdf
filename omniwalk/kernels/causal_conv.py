"""Short causal depthwise convolution with a carried state (Gated DeltaNet, Mamba).

Each channel is convolved over time with its own `kernel_size` taps, seeing only the
present and past inputs. A sequence computed in pieces (prefill chunks, then one decode
step at a time) carries the last `kernel_size - 1` inputs from one piece to the next:

    state (K-1 = 3)      new inputs x0 x1
    [ s0  s1  s2 ] [ x0  x1 ]             y0 = w . [s0 s1 s2 x0]
                                          y1 = w . [s1 s2 x0 x1]
    next state:  [ s2  x0  x1 ]

A fresh sequence starts from a zero state, which is the zero left padding of a plain
causal convolution. `causal_conv1d` is the torch reference (and the prefill path);
`causal_conv1d_decode`, one new input per sequence, is one Triton kernel on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.state_rows import StateRows
from omniwalk.kernels.triton_support import triton, use_triton

if triton is not None:
    import triton.language as tl


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


def ragged_causal_conv1d(
    x: torch.Tensor,          # [tokens, channels]: the new inputs of a ragged batch
    weight: torch.Tensor,     # [channels, kernel_size]
    state: torch.Tensor,      # [sequences, channels, kernel_size - 1]: each sequence's inputs before its tokens
    conv_gather: torch.Tensor,    # [tokens, kernel_size]: see `omniwalk.engine.ragged`
    conv_state: torch.Tensor,     # [sequences, kernel_size - 1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d` + SiLU of every sequence of a ragged batch at once (decode rows and
    prefill pieces alike): each token's window is gathered from [states; tokens] by index,
    so the launches do not grow with the number of sequences, and the shapes depend on the
    token and sequence counts alone (a CUDA graph can hold it). Returns the outputs
    [tokens, channels] (x's dtype) and the new states (state's shape and dtype)."""
    carried = state.shape[-1]
    rows = torch.cat([state.transpose(1, 2).reshape(-1, state.shape[1]).to(weight.dtype), x.to(weight.dtype)])
    windows = rows[conv_gather]                                    # [tokens, kernel, channels]
    # contiguous: einsum may hand back [tokens, channels] transposed, and the recurrent
    # kernel reads each token's q | k | v as contiguous rows
    out = F.silu(torch.einsum("tkc,ck->tc", windows, weight)).contiguous()
    new_state = rows[conv_state].transpose(1, 2).reshape(state.shape[0], state.shape[1], carried)
    return out.to(x.dtype), new_state.to(state.dtype)


def causal_conv1d_decode(
    x: torch.Tensor,          # [batch, channels]: one new input per sequence
    weight: torch.Tensor,     # [channels, kernel_size]
    state: StateRows,         # pool [rows, channels, kernel_size - 1]
    parts: tuple[int, int, int] | None = None,
) -> list[torch.Tensor]:
    """A decode step of `causal_conv1d` + SiLU: returns the outputs, and writes each
    sequence's new state to its `state.write` row.

    The outputs come as `parts` (channel counts summing to `channels`: Gated DeltaNet's
    q | k | v), each a contiguous [batch, part] tensor, or as one [batch, channels] tensor.
    One kernel on CUDA instead of a gather, a concatenation, a convolution, the SiLU, the
    state slice and the copy back; it rounds where the torch version rounds (sum in fp32,
    then the weight dtype)."""
    batch, channels = x.shape
    parts = parts or (channels, 0, 0)
    if sum(parts) != channels:
        raise ValueError(f"parts {parts} do not add up to {channels} channels")
    if not use_triton(x):
        out, new_state = causal_conv1d(x[:, None], weight, state.gather())
        state.scatter(new_state)
        pieces = out[:, 0].split(list(parts), dim=-1)
        return [piece.contiguous() for piece, width in zip(pieces, parts) if width]
    pool = state.pool
    if pool.stride(2) != 1 or pool.stride(1) != pool.shape[2]:
        raise ValueError("each conv state row must be contiguous")
    taps = weight.shape[1]
    out = torch.empty(batch * channels, dtype=x.dtype, device=x.device)   # part-major: all q, all k, all v
    block = min(256, triton.next_power_of_2(channels))
    _conv_decode_kernel[(batch, triton.cdiv(channels, block))](
        x, weight, pool, state.read, state.write, out, x.stride(0), weight.stride(0), pool.stride(0),
        channels, batch, parts[0], parts[0] + parts[1], TAPS=taps, BLOCK=block)
    outputs, start = [], 0
    for width in parts:
        if width:
            outputs.append(out[start : start + batch * width].view(batch, width))
            start += batch * width
    return outputs


if triton is not None:

    @triton.jit
    def _conv_decode_kernel(x_ptr, weight_ptr, pool_ptr, read_ptr, write_ptr, out_ptr,
                            stride_x, stride_weight, stride_row, channels,
                            batch, end_first, end_second, TAPS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < channels
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        w_dtype = weight_ptr.dtype.element_ty
        # window = [state_0 .. state_{TAPS-2}, x]; output = silu(sum_j w_j * window_j)
        acc = tl.load(weight_ptr + cols * stride_weight + (TAPS - 1), mask=mask, other=0.0).to(tl.float32) \
            * x.to(w_dtype).to(tl.float32)
        state_row = pool_ptr + tl.load(read_ptr + row) * stride_row + cols * (TAPS - 1)
        new_state_row = pool_ptr + tl.load(write_ptr + row) * stride_row + cols * (TAPS - 1)
        for j in tl.static_range(TAPS - 1):
            s = tl.load(state_row + j, mask=mask, other=0.0)
            w = tl.load(weight_ptr + cols * stride_weight + j, mask=mask, other=0.0).to(tl.float32)
            acc += w * s.to(w_dtype).to(tl.float32)
            if j > 0:   # the state shifts left by one; x enters at the end
                tl.store(new_state_row + (j - 1), s, mask=mask)
        tl.store(new_state_row + (TAPS - 2), x.to(pool_ptr.dtype.element_ty), mask=mask)
        conv = acc.to(w_dtype).to(tl.float32)
        # part-major output: channel c of part p lands in part p's contiguous [batch, width] block
        dst = tl.where(cols < end_first, row * end_first + cols,
                       tl.where(cols < end_second,
                                batch * end_first + row * (end_second - end_first) + (cols - end_first),
                                batch * end_second + row * (channels - end_second) + (cols - end_second)))
        tl.store(out_ptr + dst, (conv / (1.0 + tl.exp(-conv))).to(w_dtype).to(out_ptr.dtype.element_ty), mask=mask)
