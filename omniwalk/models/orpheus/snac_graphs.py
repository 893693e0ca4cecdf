"""SNAC decodes of full windows as CUDA graphs, one per window-count bucket.

Every step of a busy Orpheus server decodes a batch of full 4-frame windows; eagerly that
is ~530 kernel launches (Snake, transposed and dilated convolutions, noise), several
milliseconds of host time on the step's critical path. All full windows have the same
shapes, so a graph per batch bucket replays the whole decoder in one launch:

    static inputs    codes of the 3 levels   [B, frames], [B, 2 * frames], [B, 4 * frames]
                     noise keys per block    [blocks, B] as the (low, high) 32-bit halves
    static output    audio                   [B, frames * hop_length], or the samples in `keep`
    rows n .. B-1    codes 0, keys 0         (results dropped)

The noise is `SeededNoise`'s: the same hash of (row key, block, time step), computed in
the graph from the key buffers, so a window's samples do not depend on the path.
On a CPU nothing is captured and `run` computes the same forward eagerly from the same
buffers (how CI checks the path).

A set decodes only the samples in `keep` (SnacDecoder's keep: the least input that
determines them). The executor holds one set per range a full window emits (model.py:
a request's first window, its centre frames, the final flush); a centre is about half
the work of a whole window.
"""

from __future__ import annotations


import numpy as np
import torch

from omniwalk.engine.cuda_graphs import batch_buckets, capture_per_bucket
from omniwalk.engine.sampler import row_keys
from omniwalk.kernels.sampling import _uniform
from omniwalk.models.orpheus.snac import SnacDecoder, gaussian

LEVEL_CODES = (1, 2, 4)   # codes per frame on SNAC's three levels (7 in all)
FRAME_LAYOUT = ((0,), (1, 4), (2, 3, 5, 6))   # each level's codes among a frame's 7


class KeyedNoise:
    """`SeededNoise` for rows whose per-block keys sit in device tensors (graph inputs)."""

    def __init__(self, low: torch.Tensor, high: torch.Tensor):
        self.low, self.high = low, high   # [blocks, rows] int64: halves of row_key(key, block)

    def __call__(self, index: int, x: torch.Tensor, start: int = 0, total: int | None = None) -> torch.Tensor:
        steps = x.shape[2]
        total = total or steps
        tokens = torch.arange(2 * total, dtype=torch.int64, device=x.device).unsqueeze(0)
        u = _uniform(tokens, self.low[index].unsqueeze(1), self.high[index].unsqueeze(1))   # float64 (0, 1)
        return gaussian(u, start, steps, total).to(x.dtype).unsqueeze(1)


class SnacGraphs:
    def __init__(self, decoder: SnacDecoder, frames: int, max_windows: int, keep: tuple[int, int] | None = None):
        """`keep`: the graphs compute only these samples of each window (SnacDecoder's keep)."""
        self.decoder = decoder
        self.frames = frames
        self.keep = keep
        self.device = next(decoder.parameters()).device
        self.on_cuda = self.device.type == "cuda"
        self.buckets = batch_buckets(max_windows)
        self.max_windows = self.buckets[-1]
        self.num_blocks = len(decoder.config.decoder_rates) if decoder.config.noise else 0
        on = dict(device=self.device)
        self.codes = [torch.zeros(self.max_windows, frames * n, dtype=torch.long, **on) for n in LEVEL_CODES]
        self.keys = torch.zeros(2, max(self.num_blocks, 1), self.max_windows, dtype=torch.long, **on)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Pinned host staging, one set per part of a run: a part's copies are queued on the
        # codec's stream behind the previous part's replay, so a shared set would make the
        # host wait for each replay before it could stage the next part (~3 replays, every
        # step on which 256 streams complete a frame).
        self._staging: list[_Staging] = []

    def _forward(self, batch: int) -> torch.Tensor:
        noise = KeyedNoise(self.keys[0, :, :batch], self.keys[1, :, :batch]) if self.num_blocks else None
        return self.decoder([codes[:batch] for codes in self.codes], noise, self.keep)[:, 0]   # [batch, samples]

    @torch.inference_mode()
    def capture(self) -> None:
        if self.on_cuda:
            self.graphs = capture_per_bucket(self.device, self.buckets, self._forward)

    def run(self, codes: np.ndarray, keys) -> torch.Tensor:
        """Audio [n, frames * hop_length] of n full windows (the `keep` samples if set): `codes` [n, frames * 7] int
        (frame-major, as the LM emits them), `keys` the windows' noise keys."""
        if len(keys) <= self.max_windows:
            return self._run_part(codes, keys, self._staging_set(0))
        outputs = []
        for index, start in enumerate(range(0, len(keys), self.max_windows)):
            part = slice(start, start + self.max_windows)
            # the next replay reuses the output
            outputs.append(self._run_part(codes[part], keys[part], self._staging_set(index)).clone())
        return torch.cat(outputs)

    def _staging_set(self, index: int) -> "_Staging":
        while len(self._staging) <= index:
            self._staging.append(_Staging(self))
        staging = self._staging[index]
        if staging.copied is not None:
            staging.copied.synchronize()   # its copies of a step or more ago: long done
        return staging

    def _run_part(self, codes: np.ndarray, keys, staging: "_Staging") -> torch.Tensor:
        n = len(keys)
        batch = next(b for b in self.buckets if b >= n)
        frames = np.asarray(codes, dtype=np.int64).reshape(n, self.frames, sum(LEVEL_CODES))
        for level, positions in enumerate(FRAME_LAYOUT):   # per level: [frame 0's codes, frame 1's, ...]
            host = staging.codes[level].numpy()
            host[:n] = frames[:, :, positions].reshape(n, -1)
            host[n:batch] = 0
            self.codes[level][:batch].copy_(staging.codes[level][:batch], non_blocking=True)
        if self.num_blocks:
            halves = staging.keys.numpy()
            halves[:, :, :batch] = 0
            for block in range(self.num_blocks):
                block_keys = row_keys(keys, block)
                halves[0, block, :n] = (block_keys & np.uint64(0xFFFFFFFF)).astype(np.int64)
                halves[1, block, :n] = (block_keys >> np.uint64(32)).astype(np.int64)
            self.keys[:, :, :batch].copy_(staging.keys[:, :, :batch], non_blocking=True)
        if not self.on_cuda:
            return self._forward(batch)[:n]
        staging.copied = torch.cuda.Event()
        staging.copied.record()
        graph, audio = self.graphs[batch]
        graph.replay()
        return audio[:n]


class _Staging:
    """Pinned host copies of one replay's inputs, and the event recorded after their copies."""

    def __init__(self, graphs: SnacGraphs):
        pinned = dict(pin_memory=graphs.on_cuda)
        windows = graphs.max_windows
        self.codes = [torch.zeros(windows, graphs.frames * n, dtype=torch.long, **pinned) for n in LEVEL_CODES]
        self.keys = torch.zeros(2, max(graphs.num_blocks, 1), windows, dtype=torch.long, **pinned)
        self.copied: torch.cuda.Event | None = None
