"""Whisper's log-mel features in torch, matching transformers' `WhisperFeatureExtractor`.

Audio (16 kHz mono float32) becomes the mel frames of the whole recording (100 a second),
from which the decoder takes 30 s windows (3000 frames) at a frame offset, `seek`:

    up to 30 s:  the audio zero-padded to 30 s, featurized: 3000 frames, one window
                 (the extractor's default call: what `generate` calls short-form)
    longer:      the whole audio featurized, n_samples // hop frames (the extractor with
                 truncation=False, padding="longest": `generate`'s long-form input);
                 a window is frames [seek, seek + 3000), zero-padded past the end

    frames:   |------------------------------ 6500 ------------------------------|
    seek 0:   [          3000           ]
    seek 2964:                    [          3000           ]
    seek 5928:                                                [  572  + 2428 zeros ]

Without timestamps the windows follow each other (seek 0, 3000, 6000, ...); with them
the model's last timestamp decides where the next one starts (timestamps.py).

As the extractor: |STFT|^2 (n_fft 400, hop 160, Hann window, centred, last frame
dropped) -> mel filters (Slaney scale and norm, 0..8 kHz) -> log10(max(., 1e-10)) ->
max(., max over the recording - 8) -> (. + 4) / 4. A long recording's STFT runs in blocks
of windows, so its memory is the mel frames', not the spectrum's.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class MelFrames:
    """The mel frames of one recording, and the windows the encoder takes from them."""

    frames: torch.Tensor          # [num_mel_bins, num_frames] float32
    window_frames: int            # frames of one window (3000)
    audio_frames: int = 0         # frames of audio (fewer than num_frames where it was padded)

    @property
    def num_frames(self) -> int:
        """Frames the windows cover (3000 for audio up to 30 s: it was padded to one window)."""
        return self.frames.shape[1]

    def window_length(self, seek: int) -> int:
        """Frames of audio in the window at `seek` (the rest is padding)."""
        return min(self.window_frames, self.num_frames - seek)

    def window_audio_frames(self, seek: int) -> int:
        """Frames of the recording itself in the window at `seek` (not its padding); the
        window's frames where it lies in the padding (a short clip's later windows)."""
        frames = min(self.window_frames, self.audio_frames - seek)
        return frames if frames > 0 else self.window_length(seek)

    def window(self, seek: int) -> torch.Tensor:
        """[num_mel_bins, window_frames]: frames [seek, seek + window_frames), zeros past the end."""
        if not 0 <= seek < self.num_frames:
            raise ValueError(f"seek {seek} is outside the {self.num_frames} frames")
        part = self.frames[:, seek : seek + self.window_frames]
        return torch.nn.functional.pad(part, (0, self.window_frames - part.shape[1]))

    def windows(self, seeks) -> torch.Tensor:
        """[len(seeks), num_mel_bins, window_frames]"""
        return torch.stack([self.window(seek) for seek in seeks])

    @property
    def consecutive_seeks(self) -> tuple[int, ...]:
        """The windows' seeks when each one starts where the one before ends (no timestamps)."""
        return tuple(range(0, self.num_frames, self.window_frames))


class LogMelFeatures:
    """audio [samples] float32 -> MelFrames (see the module docstring)."""

    BLOCK_WINDOWS = 8     # windows of frames per STFT block of a long recording

    def __init__(self, config: FeatureConfig = FeatureConfig(), device: torch.device | str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        filters = mel_filters(config.num_mel_bins, config.n_fft, config.sampling_rate)
        self.filters_t = torch.from_numpy(filters).to(self.device, torch.float32).T.contiguous()  # [mels, bins]
        self.window = torch.hann_window(config.n_fft, device=self.device)

    @torch.inference_mode()
    def __call__(self, audio: np.ndarray | torch.Tensor) -> MelFrames:
        config = self.config
        samples = torch.as_tensor(audio, dtype=torch.float32, device=self.device).reshape(-1)
        if samples.numel() == 0:
            raise ValueError("the audio is empty")
        audio_frames = samples.numel() // config.hop_length
        live_samples = samples.numel()
        if samples.numel() <= config.window_samples:
            samples = torch.nn.functional.pad(samples, (0, config.window_samples - samples.numel()))
        log_spec = self._log_mel(samples, live_samples)
        peak = log_spec.max()                        # over the whole recording
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return MelFrames((log_spec + 4.0) / 4.0, config.num_frames, audio_frames)

    def _log_mel(self, samples: torch.Tensor, live_samples: int) -> torch.Tensor:
        """log10 mel power [mels, samples // hop], in blocks of frames (centred STFT: the
        signal reflect-padded once, each block framed from it without padding of its own).
        Samples from `live_samples` on are the zeros a short clip is padded with: the frames
        that see nothing else have zero power, so they are filled, not transformed (a 5 s
        clip's 30 s window: a sixth of the work)."""
        config = self.config
        hop, n_fft = config.hop_length, config.n_fft
        num_frames = samples.numel() // hop          # the centred STFT's last frame is dropped
        if samples.numel() - live_samples > n_fft // 2:   # the end's reflection is zeros too
            # frame t sees samples [t * hop - n_fft / 2, t * hop + n_fft / 2)
            num_live = min(num_frames, -(-(live_samples + n_fft // 2) // hop))
        else:
            num_live = num_frames
        padded = torch.nn.functional.pad(samples[None, None], (n_fft // 2, n_fft // 2), mode="reflect")[0, 0]
        block = self.BLOCK_WINDOWS * config.num_frames
        parts = []
        for first in range(0, num_live, block):
            count = min(block, num_live - first)
            piece = padded[first * hop : (first + count - 1) * hop + n_fft]
            stft = torch.stft(piece, n_fft, hop, window=self.window, center=False, return_complex=True)
            mel = self.filters_t @ (stft.abs() ** 2)                 # [mels, count]
            parts.append(torch.clamp(mel, min=1e-10).log10())
        if num_live < num_frames:
            silent = torch.zeros(self.filters_t.shape[0], num_frames - num_live, device=samples.device)
            parts.append(torch.clamp(silent, min=1e-10).log10())
        return torch.cat(parts, dim=1)
