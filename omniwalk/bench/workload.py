"""What `omniwalk bench` sends, and when.

    LengthRange.parse("128") / LengthRange.parse("100:200")   a fixed or uniform (inclusive) length
    normal_vocabulary(tokenizer)                  the ids a random prompt may use
    synthetic_requests(n, input_len, output_len, vocabulary, seed, stream)
    file_requests(prompts, tokenizer, n, output_len, seed, stream)
    with_audio(requests, seconds, seed, stream)   each request with one seeded clip (audio in)
    arrival_gaps(n, request_rate, seed)           closed loop (all 0) or seeded Poisson gaps

Every request carries token ids, never text: a benchmark that re-tokenizes text counts
something other than what the server produced. An audio-in workload (`--audio-seconds`)
adds one synthetic clip per request; the prompt stays random ids (a frontend that reads
audio puts the clip's placeholder first when the prompt has none). Draws are seeded per purpose (`stream`):
the measured requests are the same with or without warmup, and the same at every
concurrency of one invocation.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

# seed streams: one generator per purpose, so changing one draw never shifts another
MEASURED, WARMUP, ARRIVALS, AUDIO, SPEECH = 0, 1, 2, 3, 4   # SPEECH: --speak's frame budgets and seeds

SAMPLE_RATE = 16000          # of every synthetic clip (mono float32)
MAX_AUDIO_SECONDS = 600.0


@dataclass(frozen=True)
class LengthRange:
    """A length drawn uniformly from [low, high] (both included); low == high is a fixed length."""

    low: int
    high: int

    def __post_init__(self):
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str | int) -> "LengthRange":
        """`128` or `100:200`."""
        try:
            if isinstance(text, int) or ":" not in text:
                return cls(int(text), int(text))
            low, high = text.split(":")
            return cls(int(low), int(high))
        except ValueError as exc:
            if "length range" in str(exc):
                raise
            raise ValueError(f"a length is N or LOW:HIGH, got {text!r}") from None

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: prompt ids and the output budget (max_tokens) it asks for;
    in an audio-in workload also one clip, built with the workload so that no timed run
    synthesizes or encodes audio."""

    index: int
    prompt_token_ids: list[int]
    output_len: int
    # audio: [samples] float32 mono at SAMPLE_RATE (in-process); audio_url: the same clip as a
    # 16-bit PCM WAV data URL (HTTP), None unless asked for
    audio: np.ndarray | None = field(default=None, compare=False, repr=False)
    audio_url: str | None = field(default=None, compare=False, repr=False)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def audio_seconds(self) -> float:
        return 0.0 if self.audio is None else len(self.audio) / SAMPLE_RATE


def normal_vocabulary(tokenizer, model_vocab_size: int | None = None) -> np.ndarray:
    """Ids of the tokenizer's base vocabulary (added tokens excluded) less every special id."""
    size = tokenizer.vocab_size if model_vocab_size is None else min(tokenizer.vocab_size, model_vocab_size)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = np.setdiff1d(np.arange(size), np.fromiter(special, dtype=np.int64, count=len(special)))
    if len(ids) == 0:
        raise ValueError("the tokenizer has no normal (non-special) ids to draw prompts from")
    return ids


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def synthetic_requests(num: int, input_len: LengthRange, output_len: LengthRange, vocabulary: np.ndarray,
                       seed: int, stream: int = MEASURED) -> list[BenchRequest]:
    """Random-token prompts: each id drawn uniformly from `vocabulary`."""
    rng = _rng(seed, stream)
    requests = []
    for index in range(num):
        prompt = rng.choice(vocabulary, size=input_len.draw(rng)).tolist()
        requests.append(BenchRequest(index, prompt, output_len.draw(rng)))
    return requests


def read_prompts(path: str | Path) -> list[str | list[int]]:
    """One prompt per non-empty line, or JSONL objects with a `prompt` (text or a list of ids)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    if not (str(path).endswith((".jsonl", ".ndjson")) or lines[0].lstrip().startswith("{")):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: expected a JSON object with a `prompt`") from None
        if not prompt or not isinstance(prompt, (str, list)):
            raise ValueError(f"{path}:{number}: `prompt` must be non-empty text or a list of ids")
        prompts.append(prompt)
    return prompts


def file_requests(prompts: list[str | list[int]], tokenizer, num: int, output_len: LengthRange,
                  seed: int, stream: int = MEASURED) -> list[BenchRequest]:
    """Prompts in file order (cycled to `num`), text tokenized here as the server would."""
    rng = _rng(seed, stream)
    encoded = [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
    # warmup takes the prompts from the end of the list, so it does not pre-warm the first measured ones
    order = range(num) if stream == MEASURED else range(len(encoded) - 1, len(encoded) - 1 - num, -1)
    return [BenchRequest(index, list(encoded[i % len(encoded)]), output_len.draw(rng))
            for index, i in enumerate(order)]


def synthetic_clip(seconds: float, seed: list[int]) -> np.ndarray:
    """Seeded tones with a chirp and noise: deterministic, speech-band, float32 mono 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    tones = sum(rng.uniform(0.05, 0.2) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t) for _ in range(3))
    chirp = 0.1 * np.sin(2 * np.pi * (200 + 300 * t) * t)
    return (tones + chirp + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)


def check_audio_seconds(seconds: float) -> None:
    if not 0 < seconds <= MAX_AUDIO_SECONDS:
        raise ValueError(f"--audio-seconds must be > 0 and <= {MAX_AUDIO_SECONDS:g}, got {seconds}")


def with_audio(requests: list[BenchRequest], seconds: float, seed: int, stream: int = MEASURED,
               data_urls: bool = False) -> list[BenchRequest]:
    """The requests, each with one clip of `seconds` seeded by (seed, stream, its index);
    `data_urls`: each also as a WAV data URL, the form a request over HTTP carries."""
    out = []
    for request in requests:
        clip = synthetic_clip(seconds, [seed, AUDIO, stream, request.index])
        out.append(replace(request, audio=clip, audio_url=wav_data_url(clip) if data_urls else None))
    return out


def wav_bytes(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """The samples as a 16-bit PCM mono WAV file."""
    pcm = np.round(np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm.tobytes())
    return buffer.getvalue()


def wav_data_url(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> str:
    """`data:audio/wav;base64,...`: the samples as 16-bit PCM mono WAV."""
    return "data:audio/wav;base64," + base64.b64encode(wav_bytes(samples, sample_rate)).decode("ascii")


def arrival_gaps(num: int, request_rate: float | None, seed: int) -> list[float]:
    """Seconds to wait before sending each request: 0 for a closed loop (no rate), else
    exponential gaps of mean 1/rate (a Poisson process), the first request at once."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    gaps = _rng(seed, ARRIVALS).exponential(1.0 / request_rate, size=num)
    if num:
        gaps[0] = 0.0
    return gaps.tolist()
