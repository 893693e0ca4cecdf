"""Whisper's encoder as CUDA graphs, one per number of windows.

Every window has the same shape ([mels, 3000] -> [1500, d]), so a batch of n windows
replays the graph captured for n: eagerly the encoder is ~400 kernel launches of host
work (large-v3: ~19 ms for one window against ~5 ms of GPU time), and a batch size met
for the first time made cuDNN plan its attention on the host (~1 s, `layers/sdpa.py`).
One graph per window count, not per power of two: a window costs ~5-10 ms of GPU time,
so a batch of 9 padded to 16 would pay for 7 windows nobody sent (at 6c05357, with
buckets 1, 2, 4, 8, 16, 5 s clips at c = 32 fell from 51.6 to 41.3 req/s while c = 1
and 8 gained).

    static input     features  [max_windows, mels, frames]   the graph for n reads rows [:n]
    static output    states    [n, source_len, d]            read before the next replay

On a CPU nothing is captured: `run` computes the same forward from the same buffer.
"""

from __future__ import annotations

import torch

from omniwalk.engine.cuda_graphs import BucketGraphs
from omniwalk.models.whisper.modeling import WhisperEncoder


class EncoderGraphs(BucketGraphs):
    def __init__(self, encoder: WhisperEncoder, max_windows: int):
        self.encoder = encoder
        weight = encoder.conv1.weight
        self.device = weight.device
        self.on_cuda = self.device.type == "cuda"
        self.buckets = list(range(1, max_windows + 1))
        self.max_windows = max_windows
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
        self.features[:n].copy_(features)
        return self._replay(n, n)
