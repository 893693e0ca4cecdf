"""Token times by cross-attention alignment (transformers' `_extract_token_timestamps`,
openai-whisper's `find_alignment`): where in the audio each token of a window was spoken.

A window's decoder sequence is run once more, eagerly, with attention that keeps the
cross-attention probabilities of the checkpoint's `alignment_heads` (layer, head):

    rows:    the positions of the window's sampled tokens but its last (as transformers
             keeps them: the query at a token's own position), one per token
    weights: [heads, rows, frames]: cut to the audio's encoder frames (frames // 2),
             normalized over rows, median-filtered over frames (width 7), averaged over heads
    DTW over -weights: the path's first frame on each row is that token's time
             (0.02 s per encoder frame); the last token takes the time before it

    tokens:  <|0.00|> Hello there <|1.40|>       times: 0.00 0.12 0.48 1.38   (+ the window's start)

It is the model's own decoder (its modules) over `DenseAttention` and
`ProbingCrossAttention`, which stand in for the paged caches.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from omniwalk.models.whisper.modeling import WhisperDecoder

TIME_PER_FRAME = 0.02      # seconds per encoder frame (two mel frames)


class DenseAttention:
    """Causal self-attention over one sequence (what `PagedAttention.forward` computes)."""

    def forward(self, layer_index: int, query, key, value, scale: float, max_splits: int | None = None) -> torch.Tensor:
        # query, key, value: [T, H, D] -> [T, H, D] (max_splits: PagedAttention's, nothing to split here)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)


class ProbingCrossAttention:
    """Cross-attention over one window's encoder states that keeps the probabilities of
    the alignment heads (what `CrossAttention.forward` computes, written out)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, heads: Sequence[tuple[int, int]]):
        self.keys, self.values = keys, values     # [layers, S, H, D]
        self.heads = heads
        self.probabilities: dict[tuple[int, int], torch.Tensor] = {}    # (layer, head) -> [T, S]

    def forward(self, layer_index: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        q = query.transpose(0, 1).float()                                      # [H, T, D]
        k = self.keys[layer_index].transpose(0, 1).float()                     # [H, S, D]
        v = self.values[layer_index].transpose(0, 1).float()
        probabilities = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)   # [H, T, S]
        for layer, head in self.heads:
            if layer == layer_index:
                self.probabilities[(layer, head)] = probabilities[head]
        return (probabilities @ v).transpose(0, 1).to(query.dtype)


@torch.inference_mode()
def alignment_weights(decoder: WhisperDecoder, encoder_states: torch.Tensor, token_ids: Sequence[int],
                      heads: Sequence[tuple[int, int]]) -> torch.Tensor:
    """[len(heads), len(token_ids), S]: the alignment heads' cross-attention probabilities
    of each position of `token_ids` over `encoder_states` [S, d]."""
    keys, values = decoder.cross_key_values(encoder_states[None])               # [layers, 1, S, H, D]
    probe = ProbingCrossAttention(keys[:, 0], values[:, 0], heads)
    device = encoder_states.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    decoder(ids, torch.arange(len(ids), device=device), DenseAttention(), probe)
    return torch.stack([probe.probabilities[head] for head in heads])


def token_times(weights: torch.Tensor, num_tokens: int, audio_frames: int, median_width: int = 7) -> list[float]:
    """Seconds from the window's start of each of its `num_tokens` sampled tokens, from
    `weights` [heads, num_tokens - 1, S]: row j at token j's position (the window's last
    token is never an input, so it takes the time before it); `audio_frames`: mel frames
    of audio in the window."""
    if num_tokens <= 1:
        return [0.0] * num_tokens
    matrix = weights[..., : audio_frames // 2].float()
    std, mean = torch.std_mean(matrix, dim=-2, keepdim=True, unbiased=False)
    matrix = median_filter((matrix - mean) / std, median_width).mean(dim=0)     # [rows, frames]
    text_indices, time_indices = dynamic_time_warping(-matrix.double().cpu().numpy())
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    times = (time_indices[jumps] * TIME_PER_FRAME).tolist()
    return times + times[-1:]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of `width` along the last dim, edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = F.pad(x, (pad, pad, 0, 0), mode="reflect")
    return padded.unfold(-1, width, 1).sort()[0][..., pad]


def dynamic_time_warping(cost_matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The monotonic path of least total cost through `cost_matrix` [rows, frames], as
    (row, frame) index arrays. Ties go to a frame step, then a row step, as transformers'.

    Cell (i, j) needs (i-1, j-1), (i-1, j) and (i, j-1): every cell of one anti-diagonal
    i + j = d depends on the two before it only, so a diagonal is one vector step:

        d = 2   3   4          cost[i, j] = cost_matrix[i-1, j-1] + min(cost[i-1, j-1],
          (1,1)(1,2)(1,3)                                               cost[i-1, j], cost[i, j-1])
               (2,1)(2,2)
                    (3,1)
    """
    rows, frames = cost_matrix.shape
    cost = np.full((rows + 1, frames + 1), np.inf, dtype=np.float32)
    trace = -np.ones((rows + 1, frames + 1), dtype=np.float32)
    cost[0, 0] = 0
    for d in range(2, rows + frames + 1):
        i = np.arange(max(1, d - frames), min(rows, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        diagonal = (c0 < c1) & (c0 < c2)
        up = ~diagonal & (c1 < c0) & (c1 < c2)
        step = np.where(diagonal, 0, np.where(up, 1, 2))
        best = np.where(diagonal, c0, np.where(up, c1, c2))
        cost[i, j] = cost_matrix[i - 1, j - 1] + best
        trace[i, j] = step
    return _backtrace(trace)


def _backtrace(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    trace[0, :] = 2
    trace[:, 0] = 1
    text_indices, time_indices = [], []
    while i > 0 or j > 0:
        text_indices.append(i - 1)
        time_indices.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text_indices)[::-1], np.array(time_indices)[::-1]
