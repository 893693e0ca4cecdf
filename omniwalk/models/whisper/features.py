"""Whisper's log-mel features in torch, matching transformers' `WhisperFeatureExtractor`.

Audio (16 kHz mono float32) is cut into consecutive windows of `chunk_length` seconds
(30 s = 480000 samples); the last one is zero-padded to full length, as the extractor
pads a short clip. Each window becomes [num_mel_bins, 3000] features on its own:

    audio:    |------ 30 s ------|------ 30 s ------|-- 7 s --|
    windows:  [       w0        ][       w1        ][ w2 + 23 s of zeros ]
    features: [W = 3, num_mel_bins, 3000]

Per window, as the extractor does it: |STFT|^2 (n_fft 400, hop 160, Hann window,
centred, last frame dropped) -> mel filters (Slaney scale and norm, 0..8 kHz) ->
log10(max(., 1e-10)) -> max(., window max - 8) -> (. + 4) / 4. The clamp to the
window's maximum is per window, so a window is featurized exactly as a clip of its own.
A long recording is transcribed window by window and the windows' texts are joined
(see `transcribe.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FeatureConfig:
    """`preprocessor_config.json` of a Whisper checkpoint (WhisperFeatureExtractor's arguments)."""

    num_mel_bins: int = 80          # "feature_size"
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30          # seconds per window

    def __post_init__(self):
        for name in ("num_mel_bins", "sampling_rate", "hop_length", "n_fft", "chunk_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def window_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def num_frames(self) -> int:
        """Mel frames per window (3000 for 30 s)."""
        return self.window_samples // self.hop_length

    @classmethod
    def from_preprocessor_config(cls, hf: dict, num_mel_bins: int) -> "FeatureConfig":
        config = cls(
            num_mel_bins=hf.get("feature_size", num_mel_bins), sampling_rate=hf.get("sampling_rate", 16000),
            hop_length=hf.get("hop_length", 160), n_fft=hf.get("n_fft", 400),
            chunk_length=hf.get("chunk_length", 30),
        )
        if config.num_mel_bins != num_mel_bins:
            raise ValueError(f"preprocessor_config.json has {config.num_mel_bins} mel bins; the model "
                             f"takes {num_mel_bins}")
        return config


# ---------------------------------------------------------------- mel filters (as transformers.audio_utils)


def _hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    return np.where(log_region, 15.0 + np.log(np.maximum(freq, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), mels)


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    return np.where(log_region, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels - 15.0)), freq)


def mel_filters(num_mel_bins: int, n_fft: int, sampling_rate: int, max_frequency: float = 8000.0) -> np.ndarray:
    """[n_fft // 2 + 1, num_mel_bins] float64 triangular filters, Slaney-normalized."""
    num_bins = 1 + n_fft // 2
    mel_points = np.linspace(_hertz_to_mel(0.0), _hertz_to_mel(max_frequency), num_mel_bins + 2)
    filter_freqs = _mel_to_hertz(mel_points)                              # [mels + 2]
    fft_freqs = np.linspace(0, sampling_rate // 2, num_bins)             # [bins]
    slopes = filter_freqs[None, :] - fft_freqs[:, None]                   # [bins, mels + 2]
    widths = np.diff(filter_freqs)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (filter_freqs[2:] - filter_freqs[:-2]))[None, :]


# ---------------------------------------------------------------- features


def num_windows(num_samples: int, config: FeatureConfig) -> int:
    return max(1, math.ceil(num_samples / config.window_samples))


class LogMelFeatures:
    """audio [samples] float32 -> features [num_windows, num_mel_bins, num_frames] float32."""

    def __init__(self, config: FeatureConfig = FeatureConfig(), device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        filters = mel_filters(config.num_mel_bins, config.n_fft, config.sampling_rate)
        self.filters_t = torch.from_numpy(filters).to(self.device, torch.float32).T.contiguous()  # [mels, bins]
        self.window = torch.hann_window(config.n_fft, device=self.device)

    def windows(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[num_windows, window_samples]: consecutive windows, the last zero-padded."""
        samples = torch.as_tensor(audio, dtype=torch.float32, device=self.device).reshape(-1)
        if samples.numel() == 0:
            raise ValueError("the audio is empty")
        size = self.config.window_samples
        count = num_windows(samples.numel(), self.config)
        padded = torch.zeros(count * size, dtype=torch.float32, device=self.device)
        padded[: samples.numel()] = samples
        return padded.view(count, size)

    @torch.inference_mode()
    def __call__(self, audio: np.ndarray | torch.Tensor) -> torch.Tensor:
        config = self.config
        windows = self.windows(audio)
        stft = torch.stft(windows, config.n_fft, config.hop_length, window=self.window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()             # [W, bins, frames]
        mel = self.filters_t @ power                                  # [W, mels, frames]
        log_spec = torch.clamp(mel, min=1e-10).log10()
        peak = log_spec.amax(dim=(1, 2), keepdim=True)                # per window
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0
