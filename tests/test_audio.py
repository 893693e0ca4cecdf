"""omniwalk/audio.py: the header checks that run before any audio is decoded."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import soundfile

from omniwalk import audio
from omniwalk.audio import MEDIA_MAX_SECONDS, decode_audio, load_audio

SR = 16000


def wav(rate: int, channels: int = 1, frames: int = 100) -> bytes:
    """A 16-bit WAV of silence written with the standard library (any rate it claims)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(b"\0" * (2 * channels * frames))
    return buffer.getvalue()


def flac_silence(seconds: float, rate: int = SR, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros((int(seconds * rate), channels), np.float32), rate, format="FLAC")
    return buffer.getvalue()


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test if a file's samples are read (the header alone must refuse it)."""
    def read(*args, **kwargs):
        raise AssertionError("samples were decoded")
    monkeypatch.setattr(soundfile.SoundFile, "read", read)
    monkeypatch.setattr(audio, "resample", read)


def test_a_wav_claiming_1_hz_is_refused_from_its_header(no_decoding):
    data = wav(rate=1, frames=10_000)   # 20 KB that would resample to 160M samples at 16 kHz
    assert len(data) < 21_000
    with pytest.raises(ValueError, match="sample rate is 1 Hz; 4000 to 384000 Hz"):
        decode_audio(data, SR)
    with pytest.raises(ValueError, match="sample rate is 1 Hz"):
        load_audio(data, SR, max_seconds=MEDIA_MAX_SECONDS)


def test_rates_above_the_range_are_refused(no_decoding):
    with pytest.raises(ValueError, match="sample rate is 400000 Hz"):
        decode_audio(wav(rate=400_000), SR)


def test_nine_channels_are_refused(no_decoding):
    with pytest.raises(ValueError, match="9 channels; 1 to 8"):
        decode_audio(wav(SR, channels=9), SR)


def test_a_clip_longer_than_the_cap_is_refused_before_decoding(no_decoding):
    data = wav(8000, frames=8000 * 3)   # 3 s
    with pytest.raises(ValueError, match=r"3\.0 s long; at most 2 s"):
        decode_audio(data, SR, max_seconds=2)


def test_ten_minutes_of_silence_in_a_small_flac_meet_the_media_cap(no_decoding):
    data = flac_silence(MEDIA_MAX_SECONDS + 5)
    assert len(data) < 100_000   # FLAC compresses silence ~300x
    with pytest.raises(ValueError, match="605.0 s long; at most 600 s"):
        load_audio(data, SR, max_seconds=MEDIA_MAX_SECONDS)


def test_many_channels_at_a_high_rate_count_against_the_sample_budget(no_decoding):
    data = flac_silence(0.5, rate=96_000, channels=8)   # 0.5 s, but 384,000 samples to decode
    with pytest.raises(ValueError, match="384000 samples .8 channels at 96000 Hz.; at most 96000"):
        decode_audio(data, SR, max_seconds=1)


def test_audio_within_the_limits_decodes():
    samples = decode_audio(wav(8000, channels=2, frames=8000), SR, max_seconds=1)
    assert samples.shape == (SR,) and samples.dtype == np.float32
    assert decode_audio(wav(8000, frames=8000 * 3), SR).shape == (3 * SR,)   # no cap: any duration


def test_samples_given_as_an_array_meet_the_cap():
    with pytest.raises(ValueError, match="2.0 s long; at most 1 s"):
        load_audio(np.zeros(2 * SR, np.float32), SR, max_seconds=1)
    assert load_audio(np.zeros(SR, np.float32), SR, max_seconds=1).shape == (SR,)


def test_the_decoded_data_meets_the_cap_whatever_the_header_says(monkeypatch):
    """A header may understate its data (a streamed WAV, an MP3's estimate): decoding stops
    once the samples pass the cap."""
    monkeypatch.setattr(audio, "check_audio_header", lambda *args: None)   # as if the header said 0 frames
    with pytest.raises(ValueError, match="holds more than 2 s of samples"):
        decode_audio(wav(8000, frames=8000 * 3), SR, max_seconds=2)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000, 16001])
def test_resampling_keeps_the_band_in_any_blocks(rate):
    """A 440 Hz + 3 kHz tone comes out at its frequencies and level; fed in uneven blocks it
    gives the same samples as in one go."""
    t = np.arange(rate) / rate
    tone = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)).astype(np.float32)
    once = audio.resample(tone, rate, SR)
    assert once.shape == (round(rate * SR / rate),) and once.dtype == np.float32
    expected = 0.3 * np.sin(2 * np.pi * 440 * np.arange(SR) / SR) + 0.2 * np.sin(2 * np.pi * 3000 * np.arange(SR) / SR)
    assert np.abs(once[200:-200] - expected[200:-200]).max() < 0.01   # away from the zero-padded edges
    resampler = audio.Resampler(rate, SR)
    for block in np.array_split(tone, [1, 7, 1000, 1001, rate // 2]):
        resampler.feed(block)
    assert np.allclose(resampler.finish(), once, atol=1e-6)


def test_decoding_memory_follows_the_output():
    """A minute of 48 kHz stereo is decoded a block at a time: the peak is a few times the
    16 kHz output (3.8 MB), where decoding it whole and resampling by FFT took 30 times that."""
    import tracemalloc

    data = flac_silence(60, rate=48_000, channels=2)
    tracemalloc.start()
    try:
        samples = decode_audio(data, SR, max_seconds=MEDIA_MAX_SECONDS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert samples.shape == (60 * SR,)
    assert peak < 4 * samples.nbytes, peak
