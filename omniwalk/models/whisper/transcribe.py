"""Whisper's transcription capability: its frontend (TranscriptionRequest -> windows of
features and the forced prompt), its output processor (runtime outputs -> text deltas and
segments) and its warm-up requests.

    engine = Engine(EngineArgs("tiny-whisper"))
    for chunk in engine.submit(TranscriptionRequest(wav_bytes, language="en")):
        print(chunk.text, end="")                       # text deltas, with their token ids

Audio: bytes of a WAV/FLAC/MP3/OGG file (decoded, mixed to mono, resampled to 16 kHz),
or float32 samples at 16 kHz. Unreadable or empty audio raises ValueError.

Long audio: cut into consecutive 30 s windows (features.py), decoded in order on one
stream, each window from the same forced prompt (the request's `prompt` included). The
transcript is the windows' texts, each stripped of surrounding whitespace, joined with a
single space (empty windows skipped); the streamed deltas add up to exactly that text.
`segments` lists each window's text and token ids with its time span.

Counting: `max_output_tokens` (N) is the budget of the transcript stream: exactly N
tokens unless EOS stops it first; the stopping EOS counts toward N and is listed in
`token_ids`, but never becomes text. The budget counts tokens across windows; the EOS
that ends a window other than the last is not an output. N = None: as many as the
windows' decoder contexts hold (windows * (max_target_positions - prompt length)),
also the largest N accepted.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from omniwalk.audio import load_audio
from omniwalk.capabilities import Prepared
from omniwalk.capabilities.transcription import (
    TranscriptionChunk, TranscriptionFrontend, TranscriptionRequest, TranscriptionUsage, TranscriptSegment,
)
from omniwalk.detokenizer import IncrementalDetokenizer
from omniwalk.engine.sampler import SamplingParams
from omniwalk.models.whisper.config import WhisperConfig, WhisperGenerationConfig, language_name
from omniwalk.models.whisper.executors import WindowInfo
from omniwalk.models.whisper.features import LogMelFeatures
from omniwalk.models.whisper.model import TRANSCRIPT_STREAM, TranscriptionInputs, WhisperTranscriptionModel
from omniwalk.runtime import FinishReason, Request, RequestOutput, StopConfig, StreamParams

class TranscriptText:
    """Window texts, each stripped, joined by one space, streamed as deltas.

    Whitespace at the end of what a window produced so far is held back until more text
    follows in that window, so the deltas add up to the joined text exactly."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window: int | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.started = False       # the window has emitted text
        self.held = ""             # trailing whitespace of the window, not yet emitted
        self.any_text = False      # some window has emitted text: the next one starts with " "
        self.segments: dict[int, tuple[list[int], list[str]]] = {}

    def add(self, window: int, token: int) -> str:
        out = ""
        if window != self.window:
            out = self._end_window()
            self.window, self.detokenizer = window, IncrementalDetokenizer(self.tokenizer)
            self.started, self.held = False, ""
            self.segments[window] = ([], [])
        self.segments[window][0].append(token)
        return out + self._feed(self.detokenizer.add(token))

    def finish(self) -> str:
        return self._end_window()

    def _end_window(self) -> str:
        if self.detokenizer is None:
            return ""
        out = self._feed(self.detokenizer.flush())
        self.held, self.detokenizer = "", None
        return out

    def _feed(self, delta: str) -> str:
        prefix = ""
        if not self.started:
            delta = delta.lstrip()
            if not delta:
                return ""
            self.started = True
            prefix = " " if self.any_text else ""
            self.any_text = True
        text = self.held + delta
        body = text.rstrip()
        self.held = text[len(body):]
        self.segments[self.window][1].append(body)
        return prefix + body


class TranscriptionOutputProcessor:
    """Runtime outputs of one transcription -> TranscriptionChunks (on the engine's loop thread)."""

    ends_request = False

    def __init__(self, request_id: str, generation: WhisperGenerationConfig, window_seconds: float, tokenizer,
                 stop_ids: frozenset[int], language: str | None, duration: float, num_windows: int):
        self.request_id = request_id
        self.generation = generation
        self.window_seconds = window_seconds
        self.text = TranscriptText(tokenizer)
        self.stop_ids = stop_ids
        self.language = language
        self.duration = duration
        self.num_windows = num_windows
        self.num_ids = 0

    def process(self, out: RequestOutput) -> TranscriptionChunk:
        ids = list(out.items.get((TRANSCRIPT_STREAM, "tokens"), []))
        windows: list[WindowInfo] = out.items.get((TRANSCRIPT_STREAM, "windows"), [])
        pieces = []
        for position, (token, info) in enumerate(zip(ids, windows)):
            if self.language is None and info.language is not None:
                self.language = self.generation.language_code(info.language)
            is_stop_item = out.finished and out.finish_reason == FinishReason.STOP and position == len(ids) - 1 \
                and token in self.stop_ids
            if not is_stop_item:   # counted and returned as an id, never rendered
                pieces.append(self.text.add(info.index, token))
        self.num_ids += len(ids)
        if out.finished:
            pieces.append(self.text.finish())
        chunk = TranscriptionChunk(self.request_id, "".join(pieces), ids, self.language)
        if out.finished:
            chunk.finished = True
            chunk.finish_reason = out.finish_reason
            chunk.error = out.error
            chunk.usage = TranscriptionUsage(self.num_ids, self.duration, self.num_windows)
            chunk.segments = self._segments()
            chunk.language_name = language_name(self.language)
        return chunk

    def error_chunk(self, message: str) -> TranscriptionChunk:
        """The final chunk when processing this request's output failed (Engine._fail)."""
        return TranscriptionChunk(self.request_id, "", [], self.language, finished=True,
                                  finish_reason=FinishReason.ERROR, error=message, segments=self._segments(),
                                  usage=TranscriptionUsage(self.num_ids, self.duration, self.num_windows))

    def _segments(self) -> list[TranscriptSegment]:
        seconds = self.window_seconds
        return [TranscriptSegment(w, w * seconds, min((w + 1) * seconds, self.duration), "".join(texts), ids)
                for w, (ids, texts) in sorted(self.text.segments.items())]


class WhisperTranscriptionFrontend(TranscriptionFrontend):
    """TranscriptionRequest -> 30 s windows of log-mel features, the forced decoder prompt
    (language, task, previous text), and the transcript stream's budget and EOS."""

    def __init__(self, config: WhisperConfig, generation: WhisperGenerationConfig, features: LogMelFeatures,
                 tokenizer, eos_token_ids: frozenset[int]):
        self.config = config
        self.generation = generation
        self.features = features        # on the CPU: computed where requests are prepared
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.sampling_rate = features.config.sampling_rate
        self.positions_per_window = config.max_source_positions

    def previous_text_ids(self, text: str | None, limit: int) -> tuple[int, ...]:
        """<|startofprev|> + the last `limit` tokens of " " + text (as openai-whisper truncates)."""
        if text is None or not text.strip():
            return ()
        ids = self.tokenizer.encode(" " + text.strip(), add_special_tokens=False)
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        if any(t in special for t in ids):
            raise ValueError("the prompt contains special tokens")
        start = self.generation.prev_sot_token_id
        if start is None:
            start = self.tokenizer.convert_tokens_to_ids("<|startofprev|>")
        return (start, *ids[-limit:])

    def prepare(self, request: TranscriptionRequest, request_id: str, draw_seed: Callable[[], int]) -> Prepared:
        generation = self.generation
        samples = load_audio(request.audio, self.sampling_rate)
        max_positions = self.config.max_target_positions
        previous = self.previous_text_ids(request.prompt, max_positions // 2 - 1)
        prompt = generation.forced_prompt(request.language, request.task, previous)
        features = self.features(samples)
        num_windows = features.shape[0]
        most = num_windows * (max_positions - len(prompt))
        budget = request.max_output_tokens if request.max_output_tokens is not None else most
        if budget > most:
            raise ValueError(f"max_output_tokens ({budget}) exceeds what {num_windows} window(s) of audio can "
                             f"hold: {max_positions} decoder positions per window, {len(prompt)} of them prompt")
        seed = request.seed if request.seed is not None else draw_seed()
        stop = StopConfig(eos_ids=self.eos_token_ids)
        runtime_request = Request(request_id, TranscriptionInputs(features, prompt),
                                  {TRANSCRIPT_STREAM: StreamParams(budget, stop, request.sampling(seed), seed)})
        language = generation.language_code(prompt.language) if prompt.language is not None else None
        if language is None and not generation.is_multilingual:
            language = "en"
        duration = samples.size / self.sampling_rate
        processor = TranscriptionOutputProcessor(request_id, generation, self.features.config.chunk_length,
                                                 self.tokenizer, stop.stopping_ids(), language, duration, num_windows)
        return Prepared(runtime_request, processor, None)


def transcription_frontends(loaded) -> list[WhisperTranscriptionFrontend]:
    source = loaded.source
    return [WhisperTranscriptionFrontend(loaded.config, source["generation"], source["features"], loaded.tokenizer,
                                         loaded.eos_token_ids)]


def transcription_warmup(loaded) -> list[Request]:
    return warmup_requests(loaded.served, loaded.max_model_len)


def warmup_requests(model: WhisperTranscriptionModel, max_model_len: int) -> list[Request]:
    """Eight transcriptions of a second of seeded noise each, the language detected (the
    decoder's first pass on the encoder's output) and eight tokens decoded, built as the
    frontend builds them: what the first real requests would compile."""
    noise = np.random.default_rng(0)
    prompt = model.generation.forced_prompt(None, "transcribe")
    budget = max(1, min(8, model.config.max_target_positions - len(prompt)))
    requests = []
    for i in range(8):
        samples = (0.1 * noise.standard_normal(model.sampling_rate)).astype(np.float32)
        requests.append(Request(f"warmup-{i}", TranscriptionInputs(model.features(samples), prompt),
                                {TRANSCRIPT_STREAM: StreamParams(budget, StopConfig(), SamplingParams(seed=i), i)}))
    return requests
