"""Whisper's temperature fallback: when a window's output fails these checks it is decoded
again at the next temperature of the request's schedule (openai-whisper's
`transcribe(temperature=(0.0, 0.2, ..., 1.0))`, transformers' `generate_with_fallback`):

    too repetitive     compression ratio > 2.4: the window's token ids (EOS included, when
                       sampled) as little-endian bytes, over their zlib-compressed size
                       (transformers' measure; openai-whisper compresses the text instead)
    too unlikely       average log-probability < -1.0: of each sampled token (EOS included)
                       under the distribution it was sampled from, masks applied, at
                       temperature 1

The window at the last temperature is kept whatever it scores. Not checked: openai-whisper's
no-speech probability (a window it would skip as silence is decoded like any other).
"""

from __future__ import annotations

import math
import zlib
from typing import Sequence

COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0


def compression_ratio(tokens: Sequence[int], vocab_size: int) -> float:
    """Bytes of the ids over bytes of their zlib compression (transformers' measure)."""
    width = int(math.log2(vocab_size) / 8) + 1
    data = b"".join(t.to_bytes(width, "little") for t in tokens)
    return len(data) / len(zlib.compress(data))


def window_fails(tokens: Sequence[int], logprob_sum: float, num_logprobs: int, vocab_size: int) -> bool:
    """Whether a window's output is decoded again at the next temperature: `tokens` its
    samples (EOS included when sampled), `logprob_sum` over `num_logprobs` of them."""
    if tokens and compression_ratio(tokens, vocab_size) > COMPRESSION_RATIO_THRESHOLD:
        return True
    return num_logprobs > 0 and logprob_sum / num_logprobs < LOGPROB_THRESHOLD
