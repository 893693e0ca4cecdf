"""Multimodal rotary positions of a Thinker prompt (transformers' `get_rope_index`, for
text, audio and images).

Every token takes the next position, except an image's patches: patch (t, h, w) of a
grid gets (start + t * position_id_per_seconds, start + h, start + w), and the token after
the image continues from the largest of them plus one. So a prompt with an image ends
at a position past its length; the difference is the sequence's rope offset, which its
generated tokens keep (`SequenceState.rope_offset`):

    ids:   T  T  <vs> I I I I <ve> T        (a 2 x 2 image)
    t:     0  1   2   3 3 3 3  5   6
    h:     0  1   2   3 3 4 4  5   6        offset = (6 + 1) - 9 = -2: token 9 (the first
                                            generated) is at rotary position 7
    w:     0  1   2   3 4 3 4  5   6

Audio tokens are plain text positions (transformers uses sequential positions for them too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptPositions:
    """`rope`: [3, prompt_len] int64 (t, h, w) per token, or None when every token's three
    are its index (no image); `offset`: rotary position minus cache position past the prompt."""

    rope: np.ndarray | None
    offset: int


def prompt_positions(token_ids: list[int], image_token_id: int, image_grids: list[tuple[int, int, int]],
                     position_id_per_seconds: int) -> PromptPositions:
    """Positions of a prompt whose k-th run of `image_token_id` is image k, a grid of
    (t, h, w) merged patches (t * h * w tokens)."""
    if not image_grids:
        return PromptPositions(None, 0)
    ids = np.asarray(token_ids)
    rope = np.empty((3, len(ids)), dtype=np.int64)
    is_image = ids == image_token_id
    # starts and ends of the runs of image tokens
    edges = np.flatnonzero(np.diff(np.concatenate(([0], is_image.astype(np.int8), [0]))))
    runs = list(zip(edges[0::2], edges[1::2]))
    if len(runs) != len(image_grids):
        raise ValueError(f"the prompt has {len(runs)} image placeholder runs for {len(image_grids)} images")
    cursor, position = 0, 0     # next token index, next position
    for (start, end), (t, h, w) in zip(runs, image_grids):
        if end - start != t * h * w:
            raise ValueError(f"an image of {t}x{h}x{w} merged patches has {end - start} placeholder tokens")
        rope[:, cursor:start] = np.arange(position, position + start - cursor)
        position += start - cursor
        grid = np.indices((t, h, w)).reshape(3, -1)
        grid[0] *= position_id_per_seconds
        rope[:, start:end] = grid + position
        position = int(rope[:, start:end].max()) + 1
        cursor = end
    rope[:, cursor:] = np.arange(position, position + len(ids) - cursor)
    position += len(ids) - cursor
    return PromptPositions(rope, position - len(ids))
