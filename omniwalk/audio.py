"""Request audio -> mono float32 samples at a model's rate (16 kHz for Whisper).

Bytes of an audio file (WAV, FLAC, MP3, OGG: whatever libsndfile reads, through
`soundfile`) are decoded, channels averaged to mono, and resampled to the model's rate
by FFT (an ideal low-pass: the spectrum is cut or zero-extended to the new length).
A numpy array is taken as samples already at the model's rate.
Unreadable or empty audio raises ValueError with a message a client can act on.
"""

from __future__ import annotations

import io

import numpy as np


def decode_audio(data: bytes, sampling_rate: int) -> np.ndarray:
    """Bytes of an audio file -> [samples] float32 mono at `sampling_rate`."""
    import soundfile

    if not data:
        raise ValueError("the audio file is empty")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:   # soundfile raises LibsndfileError / RuntimeError / TypeError by cause
        # soundfile's message names an in-memory object; the client only needs the reason
        reason = str(exc).split(": ", 1)[-1] if "BytesIO" in str(exc) else str(exc)
        raise ValueError(f"could not decode the audio file (WAV, FLAC, MP3 or OGG expected): {reason}") from None
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return resample(mono, rate, sampling_rate)


def resample(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """FFT resampling: keeps the band both rates share, no aliasing."""
    if rate == target_rate or samples.size == 0:
        return np.ascontiguousarray(samples, dtype=np.float32)
    length = max(1, round(samples.size * target_rate / rate))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    bins = length // 2 + 1
    if spectrum.size < bins:
        spectrum = np.concatenate([spectrum, np.zeros(bins - spectrum.size, dtype=spectrum.dtype)])
    out = np.fft.irfft(spectrum[:bins], n=length) * (length / samples.size)
    return out.astype(np.float32)


def load_audio(audio: np.ndarray | bytes | bytearray | memoryview, sampling_rate: int) -> np.ndarray:
    """A request's audio (file bytes, or samples at `sampling_rate`) -> [samples] float32, checked."""
    if isinstance(audio, (bytes, bytearray, memoryview)):
        samples = decode_audio(bytes(audio), sampling_rate)
    elif isinstance(audio, np.ndarray):
        if audio.ndim != 1:
            raise ValueError(f"audio samples must be mono, shape [samples]; got shape {audio.shape}")
        if not np.issubdtype(audio.dtype, np.floating):
            raise ValueError(f"audio samples must be floating point in [-1, 1]; got dtype {audio.dtype}")
        samples = np.ascontiguousarray(audio, dtype=np.float32)
    else:
        raise ValueError(f"audio must be file bytes or a numpy array of samples, got {type(audio).__name__}")
    if samples.size == 0:
        raise ValueError("the audio has no samples")
    if not np.isfinite(samples).all():
        raise ValueError("the audio has NaN or infinite samples")
    return samples
