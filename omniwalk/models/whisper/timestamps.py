"""Whisper's timestamp tokens: what may be sampled next, and how a window's tokens become
segments and where the next window starts. Both as transformers does it
(`WhisperTimeStampLogitsProcessor`, `WhisperGenerationMixin._retrieve_segment`), whose
long-form loop is openai-whisper's.

Ids from `timestamp_begin` (<|0.00|>) on are timestamps 0.02 s apart, relative to the
window's start. A window decoded with timestamps reads

    <|0.00|> Hello there. <|1.40|><|1.40|> How are you? <|2.80|><|3.10|> Fi   (full: no EOS)
    |---------- segment ----------||-------- segment --------|| cut off: redecoded

A pair of consecutive timestamps closes a segment and opens the next. When the window
ends on a single timestamp (then EOS) the audio after it is silence: the next window
starts 30 s later. Otherwise the text after the last pair is dropped and the next window
starts at the pair's timestamp (seek in mel frames: 2 per timestamp step). A window
without any pair is one segment from the window's start to its last timestamp (or to its
end), and the next window starts where this one ends.

One guard transformers lacks: a window whose last pair is at <|0.00|> would start the
next window where it started, forever; here it advances to the window's end instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

TIME_PRECISION = 0.02      # seconds per timestamp step
FRAME_SECONDS = 0.01       # seconds per mel frame (hop 160 at 16 kHz)
INPUT_STRIDE = 2           # mel frames per encoder position, and per timestamp step


@dataclass(frozen=True)
class TimedSegment:
    """One segment of a window: its span in seconds of the audio and its tokens."""

    start: float
    end: float
    tokens: tuple[int, ...]     # its timestamp tokens included (as transformers' and OpenAI's)


def window_offset(seek: int) -> float:
    """Seconds into the audio of a window starting at frame `seek` (as transformers rounds it)."""
    return seek * TIME_PRECISION / INPUT_STRIDE


def split_window(tokens: Sequence[int], seek: int, window_frames: int,
                 timestamp_begin: int) -> tuple[list[TimedSegment], int]:
    """A window's sampled tokens (no EOS) -> its segments and the frames to the next window's
    start. `window_frames`: frames of audio in the window (the rest was padding)."""
    tokens = list(tokens)
    is_timestamp = [t >= timestamp_begin for t in tokens]
    offset = window_offset(seek)
    # a pair (two consecutive timestamps) ends a segment at the second one's index
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_timestamp[i] and is_timestamp[i + 1]]
    if not cuts:
        return [_whole_window(tokens, is_timestamp, offset, window_frames, timestamp_begin)], window_frames
    single_ending = is_timestamp[-2:] == [False, True]
    if single_ending:
        cuts.append(len(tokens))
    else:   # the last segment keeps the pair's second timestamp
        cuts[-1] += 1
    segments, begin = [], 0
    for k, cut in enumerate(cuts):
        piece = tokens[begin:cut]
        end_index = -2 if k == len(cuts) - 1 and not single_ending else -1
        segments.append(TimedSegment(offset + (piece[0] - timestamp_begin) * TIME_PRECISION,
                                     offset + (piece[end_index] - timestamp_begin) * TIME_PRECISION, tuple(piece)))
        begin = cut
    if single_ending:   # silence after the last timestamp: the whole window is done
        return segments, window_frames
    advance = (tokens[begin - 2] - timestamp_begin) * INPUT_STRIDE   # to the last pair's timestamp
    return segments, advance if advance > 0 else window_frames


def _whole_window(tokens: list[int], is_timestamp: list[bool], offset: float, window_frames: int,
                  timestamp_begin: int) -> TimedSegment:
    """The window as one segment: to its last timestamp, if any but <|0.00|>; else to its end."""
    last_position = int(window_frames * FRAME_SECONDS / TIME_PRECISION)
    stamps = [t for t, stamp in zip(tokens, is_timestamp) if stamp]
    if stamps and stamps[-1] != timestamp_begin:
        last_position = stamps[-1] - timestamp_begin
    return TimedSegment(offset, offset + last_position * TIME_PRECISION, tuple(tokens))


class TimestampRules:
    """What a row decoding timestamps may sample next, given its window's tokens so far
    (transformers' WhisperTimeStampLogitsProcessor, applied after the suppression masks):

      - never <|notimestamps|>;
      - the window's first token is a timestamp, at most `max_initial_timestamp_index`;
      - timestamps come in pairs: after two (or a window's first), text or EOS; after
        text then one timestamp, a timestamp or EOS (no text);
      - timestamps never decrease: at least the last one (closing a pair), else above it;
      - where the timestamps' probability mass beats every other token's, a timestamp.
    """

    def __init__(self, timestamp_begin: int, no_timestamps: int, eos: int, max_initial_index: int | None):
        self.timestamp_begin = timestamp_begin
        self.no_timestamps = no_timestamps
        self.eos = eos                       # <|endoftext|>: the ids below it are text
        self.max_initial_index = max_initial_index

    def bounds(self, window: Sequence[int], vocab: int) -> tuple[int, int, int]:
        """(ids below this one banned; timestamps allowed from, up to (excluded))."""
        begin = self.timestamp_begin
        if not window:
            last = vocab if self.max_initial_index is None else min(vocab, begin + self.max_initial_index + 1)
            return begin, begin, last
        last_is_stamp = window[-1] >= begin
        penultimate_is_stamp = len(window) < 2 or window[-2] >= begin
        text_end, stamps_end = 0, vocab
        if last_is_stamp:
            if penultimate_is_stamp:
                stamps_end = begin           # a pair (or the opening stamp): text next
            else:
                text_end = self.eos          # one stamp after text: close the pair, or end
        floor = begin
        last_stamp = next((t for t in reversed(window) if t >= begin), None)
        if last_stamp is not None:
            floor = last_stamp if last_is_stamp and not penultimate_is_stamp else last_stamp + 1
        return text_end, floor, stamps_end

    def __call__(self, logits: torch.Tensor, rows: list[int], windows: list[Sequence[int]]) -> None:
        """Masks `logits` [num_rows, vocab] (float32) in place on `rows`, whose windows'
        tokens so far are `windows`."""
        vocab = logits.shape[1]
        bounds = torch.tensor([self.bounds(window, vocab) for window in windows], dtype=torch.long)
        bounds = bounds.to(logits.device, non_blocking=True)
        ids = torch.arange(vocab, device=logits.device)
        text_end, floor, stamps_end = bounds[:, 0:1], bounds[:, 1:2], bounds[:, 2:3]
        is_stamp = ids >= self.timestamp_begin
        banned = (ids < text_end) | (is_stamp & ((ids < floor) | (ids >= stamps_end)))
        banned[:, self.no_timestamps] = True
        index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        scores = logits.index_select(0, index).masked_fill_(banned, float("-inf"))
        # timestamp if their summed probability beats the likeliest other token (as transformers:
        # log-softmax in float32, then the comparison)
        logprobs = torch.log_softmax(scores.float(), dim=-1)
        stamp_mass = logprobs[:, self.timestamp_begin :].logsumexp(dim=-1)
        best_other = logprobs[:, : self.timestamp_begin].max(dim=-1).values
        scores[:, : self.timestamp_begin].masked_fill_((stamp_mass > best_other)[:, None], float("-inf"))
        logits.index_copy_(0, index, scores)
