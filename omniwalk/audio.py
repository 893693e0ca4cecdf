"""Request audio -> mono float32 samples at a model's rate (16 kHz for Whisper).

Bytes of an audio file (WAV, FLAC, MP3, OGG: whatever libsndfile reads, through
`soundfile`) are decoded block by block, each block's channels averaged to mono and
resampled to the model's rate as it comes (`Resampler`: libsoxr, streaming), so work and
memory follow the decoded length: the output and one block.
A numpy array is taken as samples already at the model's rate.
Unreadable or empty audio raises ValueError with a message a client can act on.

The file's header is checked before anything is decoded, so a small file cannot make the
server decode or resample a huge signal (a 20 KB WAV claiming 1 Hz would be resampled to
2.8 hours at 16 kHz; a 30 KB FLAC of silence holds 10 minutes):

    sample rate    MIN_SAMPLE_RATE .. MAX_SAMPLE_RATE Hz (4 kHz .. 384 kHz)
    channels       1 .. MAX_CHANNELS (8)
    duration       at most `max_seconds` (the caller's cap; MEDIA_MAX_SECONDS = 600 for
                   audio inside a chat or /generate request; None: no cap)
    samples        frames x channels at most `max_seconds` x 96,000 (what `max_seconds`
                   of 48 kHz stereo holds), so a short 384 kHz 8-channel file cannot
                   decode to gigabytes either
    the data       decoding stops with an error once the samples pass `max_seconds`,
                   whatever the header claimed (a header may understate its data)
"""

from __future__ import annotations

import io

import numpy as np

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 4_000, 384_000
MAX_CHANNELS = 8
#: the duration cap of an audio item in a text request (chat, /generate)
MEDIA_MAX_SECONDS = 600.0
#: decoded samples (all channels) allowed per second of the duration cap: 48 kHz stereo
SAMPLES_PER_CAPPED_SECOND = 2 * 48_000


def check_audio_header(rate: int, channels: int, frames: int, max_seconds: float | None = None) -> None:
    """ValueError unless a file whose header says `rate` Hz, `channels` channels and
    `frames` frames is safe to decode (the limits in the module docstring)."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"the audio's sample rate is {rate} Hz; {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz "
                         f"are accepted")
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"the audio has {channels} channels; 1 to {MAX_CHANNELS} are accepted")
    if max_seconds is None:
        return
    seconds = frames / rate
    if seconds > max_seconds:
        raise ValueError(f"the audio is {seconds:.1f} s long; at most {max_seconds:g} s are accepted")
    if frames * channels > max_seconds * SAMPLES_PER_CAPPED_SECOND:
        raise ValueError(f"the audio has {frames * channels} samples ({channels} channels at {rate} Hz); at most "
                         f"{int(max_seconds * SAMPLES_PER_CAPPED_SECOND)} are accepted ({max_seconds:g} s of "
                         f"48 kHz stereo)")


def decode_audio(data: bytes, sampling_rate: int, max_seconds: float | None = None) -> np.ndarray:
    """Bytes of an audio file -> [samples] float32 mono at `sampling_rate`. The header is
    checked first (`check_audio_header`, duration capped at `max_seconds`); then the file is
    decoded block by block, each block mixed to mono and resampled as it comes, so memory
    holds the output and one block, and a file holding more audio than its header says
    is refused once the decoded data passes the cap."""
    import soundfile

    if not data:
        raise ValueError("the audio file is empty")
    try:
        file = soundfile.SoundFile(io.BytesIO(data))
    except Exception as exc:   # soundfile raises LibsndfileError / RuntimeError / TypeError by cause
        raise _unreadable(exc) from None
    with file:
        rate = file.samplerate
        check_audio_header(rate, file.channels, file.frames, max_seconds)
        max_frames = None if max_seconds is None else int(max_seconds * rate)
        resampler = Resampler(rate, sampling_rate)
        for mono in _mono_blocks(file, max_frames):
            resampler.feed(mono)
    return resampler.finish()


#: frames decoded at a time: a block of 8 channels of float32 is 2 MB
DECODE_BLOCK_FRAMES = 2**16


def _mono_blocks(file, max_frames: int | None):
    """The file's frames, DECODE_BLOCK_FRAMES at a time, mixed to mono (float32); ValueError
    when the data runs past `max_frames`, whatever the header said."""
    block = np.empty((DECODE_BLOCK_FRAMES, file.channels), dtype=np.float32)
    decoded = 0
    while True:
        try:
            frames = file.read(out=block)
        except Exception as exc:
            raise _unreadable(exc) from None
        if len(frames) == 0:
            return
        decoded += len(frames)
        if max_frames is not None and decoded > max_frames:
            raise ValueError(f"the audio holds more than {max_frames / file.samplerate:g} s of samples (its header "
                             f"says {file.frames / file.samplerate:.1f} s); at most {max_frames / file.samplerate:g} "
                             f"s are accepted")
        yield frames.mean(axis=1, dtype=np.float32) if file.channels > 1 else frames[:, 0].copy()
        if len(frames) < DECODE_BLOCK_FRAMES:
            return


def _unreadable(exc: Exception) -> ValueError:
    # soundfile's message names an in-memory object; the client only needs the reason
    reason = str(exc).split(": ", 1)[-1] if "BytesIO" in str(exc) else str(exc)
    return ValueError(f"could not decode the audio file (WAV, FLAC, MP3 or OGG expected): {reason}")


def resample(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """[samples] at `rate` -> float32 at `target_rate` (`Resampler`, in one go)."""
    resampler = Resampler(rate, target_rate)
    resampler.feed(np.asarray(samples, dtype=np.float32))
    return resampler.finish()


class Resampler:
    """Streaming band-limited resampling by libsoxr (`soxr.ResampleStream`, its "HQ" quality:
    a linear-phase filter whose pass band is flat to 0.01 dB), block by block: memory is the
    output plus the filter's state, whatever the length. Blocks of any sizes give the same
    samples as one block; n input samples give round(n * target_rate / rate) outputs."""

    def __init__(self, rate: int, target_rate: int):
        import soxr

        self.stream = None if rate == target_rate else soxr.ResampleStream(rate, target_rate, 1, dtype="float32",
                                                                           quality="HQ")
        self.parts: list[np.ndarray] = []

    def feed(self, samples: np.ndarray) -> None:
        samples = np.asarray(samples, dtype=np.float32)
        self.parts.append(samples if self.stream is None else self.stream.resample_chunk(samples))

    def finish(self) -> np.ndarray:
        if self.stream is not None:
            self.parts.append(self.stream.resample_chunk(np.zeros(0, np.float32), last=True))
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.float32)


def load_audio(audio: np.ndarray | bytes | bytearray | memoryview, sampling_rate: int,
               max_seconds: float | None = None) -> np.ndarray:
    """A request's audio (file bytes, or samples at `sampling_rate`) -> [samples] float32, checked
    (at most `max_seconds` long when given)."""
    if isinstance(audio, (bytes, bytearray, memoryview)):
        samples = decode_audio(bytes(audio), sampling_rate, max_seconds)
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
    if max_seconds is not None and samples.size > max_seconds * sampling_rate:
        raise ValueError(f"the audio is {samples.size / sampling_rate:.1f} s long; at most {max_seconds:g} s "
                         f"are accepted")
    if not np.isfinite(samples).all():
        raise ValueError("the audio has NaN or infinite samples")
    return samples
