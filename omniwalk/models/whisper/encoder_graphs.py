"""Whisper's encoder as CUDA graphs, one per window-count bucket.

Every window has the same shape ([mels, 3000] -> [1500, d]), so a batch of n windows
replays the graph of the smallest bucket >= n: eagerly the encoder is ~400 kernel
launches of host work (large-v3: ~19 ms for one window against ~5 ms of GPU time), and
a batch size met for the first time made cuDNN plan its attention on the host (~1 s,
`layers/sdpa.py`). Windows do not see each other (per-position norms and GEMMs,
attention within a window), so the rows of a bucket past n hold whatever they held and
their results are dropped.

    static input     features  [max_windows, mels, frames]   rows n .. bucket-1: stale
    static output    states    [bucket, source_len, d]       read [:n] before the next replay

On a CPU nothing is captured: `run` computes the same forward from the same buffer.
"""

from __future__ import annotations

import torch

from omniwalk.engine.cuda_graphs import BucketGraphs, batch_buckets
from omniwalk.models.whisper.modeling import WhisperEncoder


class EncoderGraphs(BucketGraphs):
    def __init__(self, encoder: WhisperEncoder, max_windows: int):
        self.encoder = encoder
        weight = encoder.conv1.weight
        self.device = weight.device
        self.on_cuda = self.device.type == "cuda"
        self.buckets = batch_buckets(max_windows)
        self.max_windows = self.buckets[-1]
        self.features = torch.zeros(self.max_windows, encoder.conv1.in_channels, 2 * encoder.embed_positions.num_embeddings,
                                    dtype=weight.dtype, device=self.device)
        self._init_graphs()

    def _forward(self, batch: int) -> torch.Tensor:
        return self.encoder(self.features[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        self._capture()

    def run(self, features: torch.Tensor) -> torch.Tensor:
        """Encoder states [n, source_len, d] of n <= max_windows windows `features` (on the
        device); a view of the graph's output, valid until the next `run`."""
        n = features.shape[0]
        batch = next(b for b in self.buckets if b >= n)
        self.features[:n].copy_(features)
        if not self.on_cuda:   # eagerly, only the rows asked for
            return self.encoder(self.features[:n])
        return self._replay(batch, n)
