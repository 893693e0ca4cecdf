"""Request audio -> mono float32 samples at a model's rate (16 kHz for Whisper).

Bytes of an audio file (WAV, FLAC, MP3, OGG: whatever libsndfile reads, through
`soundfile`) are decoded block by block, each block's channels averaged to mono and
resampled to the model's rate as it comes (`Resampler`: windowed sinc, polyphase), so
work and memory follow the decoded length: the output and one block.
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
import math

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
    """Streaming band-limited resampling: a windowed-sinc filter (Hann window, 6 zero
    crossings each side, cut off at 0.99 x the lower Nyquist rate: torchaudio's default
    `sinc_interp_hann`), applied polyphase. Work is ~2W multiply-adds per output sample and
    memory the output plus one block of input, whatever the length.

    The rates reduce to `up / down` (44100 -> 16000: 160 / 441). Output sample m sits at
    source time t = m * down / up, between source samples i = floor(t) and i + 1; its phase
    p = (m * down) mod up picks one row of taps, weighing the 2W source samples around t:

        source  ... x[i-W+1] ... x[i] | x[i+1] ... x[i+W] ...      (zeros outside the signal)
                                      t
        y[m] = sum_k x[i + k] * taps[p, k + W - 1],   k = -W+1 .. W

    Outputs m, m + up, m + 2 up, ... share a phase and step `down` source samples apart,
    so each phase of a block is one matrix-vector product over a strided view of the input
    (a pass with few outputs per phase gathers each output's window instead: `_gather`).
    The output has round(n * target / rate) samples (at least 1), as the FFT resampler had."""

    ZERO_CROSSINGS = 6
    ROLLOFF = 0.99
    #: outputs computed per pass: at least this many, and at least 16 per phase
    BLOCK_OUTPUTS = 2**16
    #: a pass with fewer outputs per phase gathers each output's window instead
    MIN_ROWS_PER_PHASE = 8
    GATHER_OUTPUTS = 2**14

    def __init__(self, rate: int, target_rate: int):
        self.identity = rate == target_rate
        divisor = math.gcd(rate, target_rate)
        self.up, self.down = target_rate // divisor, rate // divisor
        self.received = 0                      # source samples fed so far
        self.next_output = 0                   # index of the next output sample to compute
        self.outputs: list[np.ndarray] = []
        if self.identity:
            return
        cutoff = self.ROLLOFF * min(rate, target_rate) / 2 / rate      # cycles per source sample
        reach = self.ZERO_CROSSINGS / (2 * cutoff)                      # the window's half width, in samples
        self.half_width = W = math.ceil(reach)
        # offset of tap k from the output's time, per phase: [up, 2W]
        offsets = np.arange(-W + 1, W + 1)[None, :] - np.arange(self.up)[:, None] / self.up
        window = np.where(np.abs(offsets) <= reach, np.cos(np.pi * offsets / (2 * reach)) ** 2, 0.0)
        self.taps = (2 * cutoff * np.sinc(2 * cutoff * offsets) * window).astype(np.float32)
        self.buffer = np.zeros(W - 1, dtype=np.float32)   # x[-W+1 .. -1]: the zeros before the signal
        self.buffer_start = -(W - 1)                       # the source index of buffer[0]
        self.pending: list[np.ndarray] = []
        self.pending_frames = 0
        self.block_outputs = max(self.BLOCK_OUTPUTS, 16 * self.up)

    def feed(self, samples: np.ndarray) -> None:
        """More source samples (float32 mono)."""
        self.received += samples.size
        if self.identity:
            self.outputs.append(samples)
            return
        self.pending.append(samples)
        self.pending_frames += samples.size
        if self.pending_frames * self.up >= self.block_outputs * self.down:
            self._run(self._computable_outputs())

    def finish(self) -> np.ndarray:
        """The output: every sample, float32."""
        if self.identity:
            out = np.concatenate(self.outputs) if self.outputs else np.zeros(0, np.float32)
            return np.ascontiguousarray(out, dtype=np.float32)
        if self.received:
            total = max(1, round(self.received * self.up / self.down))
            self.pending.append(np.zeros(2 * self.half_width + self.down, dtype=np.float32))   # the zeros after
            self._run(total)
        return np.concatenate(self.outputs) if self.outputs else np.zeros(0, np.float32)

    def _gather(self, start: int, out: np.ndarray) -> None:
        """out[j] = output start + j, each from its own window and phase (a short pass, or a
        rate whose `up` is large: 16001 Hz has 16000 phases, one matrix-vector product each
        would cost ~50 us per output sample)."""
        W, up, down = self.half_width, self.up, self.down
        taps = np.arange(2 * W)
        for lo in range(0, out.size, self.GATHER_OUTPUTS):
            m = np.arange(start + lo, start + min(out.size, lo + self.GATHER_OUTPUTS), dtype=np.int64)
            first = (m * down) // up - W + 1 - self.buffer_start
            windows = self.buffer[first[:, None] + taps]                 # [outputs, 2W]
            out[lo:lo + m.size] = np.einsum("ij,ij->i", windows, self.taps[(m * down) % up])

    def _computable_outputs(self) -> int:
        """Outputs m whose last tap x[i_m + W] has arrived: i_m + W < received."""
        last_source = self.received - self.half_width - 1
        return 0 if last_source < 0 else (last_source * self.up) // self.down + 1

    def _run(self, end: int) -> None:
        """Computes outputs [next_output, end) and drops the input no later output needs."""
        if self.pending:
            self.buffer = np.concatenate([self.buffer, *self.pending])
            self.pending, self.pending_frames = [], 0
        W, up, down = self.half_width, self.up, self.down
        start = self.next_output
        out = np.empty(max(0, end - start), dtype=np.float32)
        if out.size < self.MIN_ROWS_PER_PHASE * up:   # few outputs per phase: gather them instead
            self._gather(start, out)
        else:
            for r in range(up):
                m = start + r
                phase, source = (m * down) % up, (m * down) // up
                rows = len(range(r, out.size, up))
                first = source - W + 1 - self.buffer_start
                view = np.lib.stride_tricks.as_strided(self.buffer[first:], shape=(rows, 2 * W),
                                                       strides=(down * 4, 4), writeable=False)
                out[r::up] = view @ self.taps[phase]
        if out.size:
            self.outputs.append(out)
        self.next_output = max(start, end)
        keep_from = (self.next_output * down) // up - W + 1     # the first tap of the next output
        if keep_from > self.buffer_start:
            self.buffer = self.buffer[keep_from - self.buffer_start:].copy()
            self.buffer_start = keep_from


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
