"""A ragged batch's layout as the recurrent layers' kernels take it.

Sequence i owns the next lengths[i] rows of the flat token dimension. Built once per
forward pass and shared by every recurrent layer, or (`from_buffers`) made of a CUDA
graph's static buffers, which hold the layout of whatever batch the graph replays:

    lengths        [3, 1, 2]
    cu_seqlens     [0, 3, 4, 6]                 fla's kernels (device, and host for the chunk index)
    conv_gather    [tokens, kernel]             the causal conv's input window of each token,
    conv_state     [sequences, kernel - 1]      and each sequence's new conv state, as rows of
                                                [old states (sequences x (kernel - 1)); new tokens]
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from omniwalk.engine.host_to_device import to_device


def conv_window_indices(lengths: list[int], kernel: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of [states; tokens] (states: sequence n's kernel - 1 carried inputs at rows
    n * (kernel - 1) ...; tokens after all states) that make each token's conv window
    [tokens, kernel] and each sequence's new state [sequences, kernel - 1]."""
    lengths_array = np.asarray(lengths, dtype=np.int64)
    num_sequences, carried = len(lengths), kernel - 1
    starts = np.concatenate([[0], np.cumsum(lengths_array)[:-1]]).astype(np.int64)
    sequence = np.repeat(np.arange(num_sequences, dtype=np.int64), lengths_array)
    offset = np.arange(int(lengths_array.sum()), dtype=np.int64) - starts[sequence]

    def rows(seq: np.ndarray, window_start: np.ndarray, width: int) -> np.ndarray:
        # window position w: a carried input while w < kernel - 1, else new token w - (kernel - 1)
        w = window_start[:, None] + np.arange(width, dtype=np.int64)[None, :]
        from_state = seq[:, None] * carried + w
        from_tokens = num_sequences * carried + starts[seq][:, None] + w - carried
        return np.where(w < carried, from_state, from_tokens)

    gather = rows(sequence, offset, kernel)
    state = rows(np.arange(num_sequences, dtype=np.int64), lengths_array, carried)
    return gather, state


class RaggedLengths:
    """The layout above for one pass (`RaggedLengths(lengths, device, conv_kernel)`)."""

    def __init__(self, lengths: list[int], device: torch.device, conv_kernel: int | None = None):
        self.lengths = list(lengths)
        self.device = torch.device(device)
        self.conv_kernel = conv_kernel
        self.max_len = max(self.lengths)
        self.cu_seqlens_cpu = torch.tensor([0] + self.lengths, dtype=torch.long).cumsum(0)

    @classmethod
    def from_buffers(cls, cu_seqlens: torch.Tensor, conv_gather: torch.Tensor, conv_state: torch.Tensor,
                     max_len: int, lengths: list[int] | None = None) -> "RaggedLengths":
        """A graph's static layout; `max_len` bounds every sequence it will hold. `lengths`:
        the host copy, for the CPU path (which replays nothing)."""
        ragged = cls.__new__(cls)
        ragged.lengths, ragged.device, ragged.max_len = lengths, cu_seqlens.device, max_len
        ragged.conv_kernel = conv_gather.shape[1]
        ragged.cu_seqlens_cpu = None
        # the cached properties, set to the buffers
        ragged.__dict__.update(cu_seqlens=cu_seqlens, conv_indices=(conv_gather, conv_state))
        return ragged

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        return to_device(self.cu_seqlens_cpu, device=self.device)

    @functools.cached_property
    def chunk_indices(self) -> torch.Tensor:
        """fla's chunk index (64-token chunks), derived on the host: fla derives it with syncs."""
        from fla.ops.utils.index import prepare_chunk_indices
        return to_device(prepare_chunk_indices(self.cu_seqlens_cpu, 64), device=self.device)

    @functools.cached_property
    def conv_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_gather, conv_state) of the layout above, on the device."""
        gather, state = conv_window_indices(self.lengths, self.conv_kernel)
        return to_device(gather, device=self.device), to_device(state, device=self.device)
