"""Whisper's transcription capability: its frontend (TranscriptionRequest -> windows of
features and the forced prompt), its output processor (runtime outputs -> text deltas and
segments) and its warm-up requests.

    engine = Engine(EngineArgs("tiny-whisper"))
    for chunk in engine.submit(TranscriptionRequest(wav_bytes, language="en")):
        print(chunk.text, end="")                       # text deltas, with their token ids

Audio: bytes of a WAV/FLAC/MP3/OGG file (decoded, mixed to mono, resampled to 16 kHz),
or float32 samples at 16 kHz. Unreadable or empty audio raises ValueError.

Long audio: 30 s windows of its mel frames (features.py), decoded in order on one
stream, each window from the same forced prompt (the request's `prompt` included).

    no timestamps   consecutive windows; the streamed text is each window's text, stripped
                    of surrounding whitespace, windows joined with a single space (empty
                    windows skipped). `segments`: one per window with text, its span.
    timestamps      (timestamp_granularities=("segment",)) the model's segments and the
                    next window's start from its timestamp tokens (timestamps.py); a
                    window's text is streamed when it ends: its segments' texts, stripped,
                    joined with a single space like the windows'. Tokens after a window's
                    last complete segment are decoded again by the next window: they stay
                    in `token_ids` (the budget counted them) but not in the text.

    fallback        (temperature=(t0, t1, ...): fallback.py) a window that fails the checks is
                    decoded again at the next temperature; its text is streamed when the
                    window is done, like with timestamps, and is the last attempt's; every
                    attempt's tokens stay in `token_ids` (the budget counted them).

The streamed deltas add up to exactly the final text.

Counting: `max_output_tokens` (N) is the budget of the transcript stream: exactly N
tokens unless EOS stops it first; the stopping EOS counts toward N and is listed in
`token_ids`, but never becomes text. The budget counts tokens across windows; the EOS
that ends a window other than the last is not an output. N = None: as many as the
windows' decoder contexts hold (windows * (max_target_positions - prompt length), times
the temperatures with a fallback), also the largest N accepted; with timestamps the
windows are not known up front, so any N is accepted and None is as many as a window per
mel frame would hold.
"""

from __future__ import annotations

import string
from typing import Callable

import numpy as np

from omniwalk.audio import load_audio
from omniwalk.capabilities import Prepared
from omniwalk.capabilities.transcription import (
    TranscriptionChunk, TranscriptionFrontend, TranscriptionRequest, TranscriptionUsage, TranscriptSegment,
    TranscriptWord,
)
from omniwalk.detokenizer import IncrementalDetokenizer
from omniwalk.engine.sampler import SamplingParams
from omniwalk.models.whisper.config import WhisperConfig, WhisperGenerationConfig, language_name
from omniwalk.models.whisper.executors import WindowInfo, WindowTimes
from omniwalk.models.whisper.features import LogMelFeatures
from omniwalk.models.whisper.model import TRANSCRIPT_STREAM, TranscriptionInputs, WhisperTranscriptionModel
from omniwalk.models.whisper.timestamps import split_window, window_offset
from omniwalk.runtime import FinishReason, Request, RequestOutput, StopConfig, StreamParams


class TranscriptText:
    """Window texts, each stripped, joined by one space, streamed as deltas.

    Whitespace at the end of what a window produced so far is held back until more text
    follows in that window, so the deltas add up to the joined text exactly. Timestamp ids
    (which a model that was asked for none may still sample) are never text, whatever the
    tokenizer thinks of them."""

    def __init__(self, tokenizer, timestamp_begin: int | None = None):
        self.tokenizer = tokenizer
        self.timestamp_begin = timestamp_begin
        self.window: int | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.started = False       # the window has emitted text
        self.held = ""             # trailing whitespace of the window, not yet emitted
        self.any_text = False      # some window has emitted text: the next one starts with " "
        self.windows: dict[int, tuple[WindowInfo, list[int], list[str]]] = {}

    def add(self, info: WindowInfo, token: int) -> str:
        out = ""
        if info.index != self.window:
            out = self._end_window()
            self.window, self.detokenizer = info.index, IncrementalDetokenizer(self.tokenizer)
            self.started, self.held = False, ""
            self.windows[info.index] = (info, [], [])
        self.windows[info.index][1].append(token)
        if self.timestamp_begin is not None and token >= self.timestamp_begin:
            return out
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
        self.windows[self.window][2].append(body)
        return prefix + body

    def segments(self, duration: float) -> list[TranscriptSegment]:
        """One per window that sampled a token: the window's span (ending at the audio's end)."""
        return [TranscriptSegment(w, window_offset(info.seek),
                                  min(window_offset(info.seek + info.num_frames), duration), "".join(texts), ids,
                                  info.seek, info.temperature)
                for w, (info, ids, texts) in sorted(self.windows.items())]


class WindowedText:
    """Text released per window, once the window is done: its segments (timestamps.py)
    when it was decoded with timestamps, else the window as one segment; each segment's
    text stripped, non-empty ones joined by one space. A later attempt of the same window
    (the temperature fallback) replaces the earlier one's tokens. With word timestamps the
    window's token times arrive with the item after it (`WindowInfo.aligned`), and its
    words are cut from the tokens its segments keep."""

    def __init__(self, tokenizer, timestamp_begin: int, timestamps: bool, duration: float):
        self.tokenizer = tokenizer
        self.timestamp_begin = timestamp_begin
        self.timestamps = timestamps
        self.duration = duration            # a window's span ends at the audio's end
        self.window: WindowInfo | None = None
        self.tokens: list[int] = []         # the current window's (its latest attempt's)
        self.times: dict[tuple[int, int], tuple[float, ...]] = {}    # (window, attempt) -> token times
        self.any_text = False
        self.done: list[TranscriptSegment] = []
        self.words: list[TranscriptWord] = []

    def take_times(self, aligned: WindowTimes) -> None:
        self.times[(aligned.index, aligned.attempt)] = aligned.times

    def add(self, info: WindowInfo, token: int) -> str:
        out = ""
        if self.window is not None and info.index != self.window.index:
            out = self._end_window()
        elif self.window is not None and info.attempt != self.window.attempt:
            self.tokens = []                # that attempt failed the fallback's checks
        self.window = info
        self.tokens.append(token)
        return out

    def finish(self) -> str:
        return self._end_window()

    def segments(self, duration: float) -> list[TranscriptSegment]:
        return list(self.done)

    def _end_window(self) -> str:
        info, tokens = self.window, self.tokens
        if info is None:
            return ""
        self.window, self.tokens = None, []
        relative = self.times.pop((info.index, info.attempt), None)
        times = None if relative is None else [window_offset(info.seek) + t for t in relative]
        pieces, kept = [], 0
        for start, end, segment_tokens in self._spans(info, tokens):
            text = self.tokenizer.decode([t for t in segment_tokens if t < self.timestamp_begin],
                                         skip_special_tokens=True).strip()
            segment_times = None if times is None else times[kept : kept + len(segment_tokens)]
            self.done.append(TranscriptSegment(info.index, start, end, text, list(segment_tokens), info.seek,
                                               info.temperature, segment_times))
            kept += len(segment_tokens)
            if text:
                pieces.append(text)
        if times is not None:
            self.words += words_of(self.tokenizer, tokens[:kept], times, self.timestamp_begin)
        if not pieces:
            return ""
        out = (" " if self.any_text else "") + " ".join(pieces)
        self.any_text = True
        return out

    def _spans(self, info: WindowInfo, tokens: list[int]):
        if self.timestamps:
            return [(s.start, s.end, s.tokens)
                    for s in split_window(tokens, info.seek, info.num_frames, self.timestamp_begin)[0]]
        end = min(window_offset(info.seek + info.num_frames), self.duration)
        return [(window_offset(info.seek), end, tokens)]


#: punctuation that joins the word after it, or the word before it (openai-whisper's)
PREPENDED = "\"'“¿([{-"
APPENDED = "\"'.。,，!！?？:：”)]}、"


def words_of(tokenizer, tokens: list[int], times: list[float], text_end: int) -> list[TranscriptWord]:
    """Words of a window's text tokens (below `text_end`) and their times: a token whose
    text starts with a space (or is punctuation) starts a word; punctuation then joins its
    neighbour (openai-whisper's merge). A word starts at its first token's time and ends
    at the time of the token after its last (its own, for the window's last token)."""
    groups: list[list[int]] = []     # token indices of each word
    for i, token in enumerate(tokens):
        if token >= text_end or token in getattr(tokenizer, "all_special_ids", ()):
            continue
        piece = tokenizer.decode([token])
        if not groups or piece.startswith(" ") or piece.strip() in string.punctuation:
            groups.append([i])
        else:
            groups[-1].append(i)
    texts = [tokenizer.decode([tokens[i] for i in group]).strip() for group in groups]
    merged: list[tuple[str, list[int]]] = []
    pending: tuple[str, list[int]] | None = None      # prepended punctuation waiting for its word
    for text, group in zip(texts, groups):
        if pending is not None:
            text, group = pending[0] + text, pending[1] + group
            pending = None
        if text in PREPENDED and text:
            pending = (text, group)
        elif merged and text and text in APPENDED:
            merged[-1] = (merged[-1][0] + text, merged[-1][1] + group)
        elif text:
            merged.append((text, group))
    last = len(times) - 1
    return [TranscriptWord(text, times[group[0]], times[min(group[-1] + 1, last)]) for text, group in merged]


class TranscriptionOutputProcessor:
    """Runtime outputs of one transcription -> TranscriptionChunks (on the engine's loop thread)."""

    ends_request = False

    def __init__(self, request_id: str, generation: WhisperGenerationConfig, tokenizer, stop_ids: frozenset[int],
                 language: str | None, duration: float, num_windows: int | None, timestamps: bool,
                 fallback: bool = False, word_timestamps: bool = False):
        self.request_id = request_id
        self.generation = generation
        begin = generation.timestamp_begin
        if timestamps or fallback or word_timestamps:   # a window's text is known when the window is done
            self.text = WindowedText(tokenizer, begin, timestamps, duration)
        else:
            self.text = TranscriptText(tokenizer, begin)
        self.stop_ids = stop_ids
        self.language = language
        self.duration = duration
        self.num_windows = num_windows or 1    # None: counted as they come (timestamps)
        self.counts_windows = num_windows is None
        self.word_timestamps = word_timestamps
        self.num_ids = 0

    def process(self, out: RequestOutput) -> TranscriptionChunk:
        ids = list(out.items.get((TRANSCRIPT_STREAM, "tokens"), []))
        windows: list[WindowInfo] = out.items.get((TRANSCRIPT_STREAM, "windows"), [])
        pieces = []
        for position, (token, info) in enumerate(zip(ids, windows)):
            if self.language is None and info.language is not None:
                self.language = self.generation.language_code(info.language)
            if self.counts_windows:
                self.num_windows = max(self.num_windows, info.index + 1)
            is_stop_item = out.finished and out.finish_reason == FinishReason.STOP and position == len(ids) - 1 \
                and token in self.stop_ids
            if info.aligned is not None:   # word timestamps: the token times of a window that ended
                self.text.take_times(info.aligned)
            if not is_stop_item:   # counted and returned as an id, never rendered
                pieces.append(self.text.add(info, token))
        self.num_ids += len(ids)
        if out.finished:
            pieces.append(self.text.finish())
        chunk = TranscriptionChunk(self.request_id, "".join(pieces), ids, self.language)
        if out.finished:
            chunk.finished = True
            chunk.finish_reason = out.finish_reason
            chunk.error = out.error
            chunk.usage = TranscriptionUsage(self.num_ids, self.duration, self.num_windows)
            chunk.segments = self.text.segments(self.duration)
            chunk.words = getattr(self.text, "words", None) if self.word_timestamps else None
            chunk.language_name = language_name(self.language)
        return chunk

    def error_chunk(self, message: str) -> TranscriptionChunk:
        """The final chunk when processing this request's output failed (Engine._fail)."""
        return TranscriptionChunk(self.request_id, "", [], self.language, finished=True,
                                  finish_reason=FinishReason.ERROR, error=message,
                                  segments=self.text.segments(self.duration),
                                  usage=TranscriptionUsage(self.num_ids, self.duration, self.num_windows))


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
        prompt = generation.forced_prompt(request.language, request.task, previous, timestamps=request.timestamps)
        if request.word_timestamps:
            self._check_alignment_heads()
        inputs = TranscriptionInputs(self.features(samples), prompt, request.temperatures, request.word_timestamps)
        budget = self._budget(request, inputs, max_positions)
        seed = request.seed if request.seed is not None else draw_seed()
        stop = StopConfig(eos_ids=self.eos_token_ids)
        runtime_request = Request(request_id, inputs,
                                  {TRANSCRIPT_STREAM: StreamParams(budget, stop, request.sampling(seed), seed)})
        language = generation.language_code(prompt.language) if prompt.language is not None else None
        if language is None and not generation.is_multilingual:
            language = "en"
        duration = samples.size / self.sampling_rate
        num_windows = None if prompt.timestamps else len(inputs.audio.consecutive_seeks)
        processor = TranscriptionOutputProcessor(request_id, generation, self.tokenizer, stop.stopping_ids(), language,
                                                 duration, num_windows, prompt.timestamps,
                                                 fallback=len(inputs.temperatures) > 1,
                                                 word_timestamps=request.word_timestamps)
        return Prepared(runtime_request, processor, None)

    def _check_alignment_heads(self) -> None:
        heads = self.generation.alignment_heads
        if not heads:
            raise ValueError("timestamp_granularities: word needs the checkpoint's alignment_heads "
                             "(generation_config.json); this model has none")
        layers, num_heads = self.config.decoder_layers, self.config.decoder_attention_heads
        if any(not (0 <= layer < layers and 0 <= head < num_heads) for layer, head in heads):
            raise ValueError(f"timestamp_granularities: word: alignment_heads {list(heads)} name heads this "
                             f"model lacks ({layers} decoder layers of {num_heads} heads)")

    @staticmethod
    def _budget(request: TranscriptionRequest, inputs: TranscriptionInputs, max_positions: int) -> int:
        """The transcript's budget: the request's, or what the windows' decoder contexts hold."""
        prompt_len = len(inputs.prompt)
        per_window = (max_positions - prompt_len) * len(inputs.temperatures)   # each attempt's tokens count
        if inputs.prompt.timestamps:    # windows decided while decoding: each advances >= 1 frame
            return request.max_output_tokens or inputs.audio.num_frames * per_window
        num_windows = len(inputs.audio.consecutive_seeks)
        most = num_windows * per_window
        budget = request.max_output_tokens if request.max_output_tokens is not None else most
        if budget > most:
            raise ValueError(f"max_output_tokens ({budget}) exceeds what {num_windows} window(s) of audio can "
                             f"hold: {max_positions} decoder positions per window, {prompt_len} of them prompt"
                             + (f", {len(inputs.temperatures)} temperatures" if len(inputs.temperatures) > 1 else ""))
        return budget


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
