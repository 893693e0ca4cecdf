"""What the Talker reads, laid out from the Thinker's ids: a host-side plan, no tensors.

transformers (`Qwen3OmniMoeForConditionalGeneration.generate`) builds the Talker's prefill
from the Thinker's prompt and answer. Every Talker input row is a text part plus,
optionally, a codec part:

    text part    text_projection(thinker embedding of an id), or for a media placeholder
                 of a user turn hidden_projection(the Thinker's hidden state there, at
                 layer `accept_hidden_layer`)
    codec part   the Talker's codec_embedding of a codec id, or nothing

    rows                                  text part                 codec part
    every user turn of the prompt         its ids (media: hidden)   -
      (from its <|im_start|> to the next <|im_start|>, all user turns in order)
    the assistant turn's first 3 ids      <|im_start|> assistant \\n  -
    4 rows                                <tts_pad>                 nothink, think_bos, think_eos, speaker
    1 row                                 <tts_bos>                 codec_pad
    1 row                                 the turn's 4th id         codec_bos

The assistant turn is the prompt's last `<|im_start|>assistant` on, followed by the answer
(so its 4th id is the answer's first when the prompt ends in `assistant\\n`). System turns
and earlier assistant turns are not read. Decode step j (0-based) then adds to its frame's
summed codec embeddings the text part of `trailing[j]`: the turn's ids from the 5th on,
then <tts_eos>, then <tts_pad> for as long as the Talker keeps speaking.

The answer is what the client got: without the stop token (EOS) that ended it, if one did.
That is transformers' Talker input for an answer that ended on EOS (its Thinker never
embeds the last token it generated, so its text stops before the EOS). For an answer cut
by its budget transformers drops the last token as well, and its speech ends a word short
of its text; here every token of the answer is spoken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from omniwalk.models.qwen3_omni.positions import PromptPositions, prompt_positions
from omniwalk.models.qwen3_omni.talker import Talker
from omniwalk.models.qwen3_omni.talker_config import TalkerConfig, TalkerPromptTokens

NO_CODEC = -1
TTS_PADS = 4   # assistant rows whose text part is tts_pad: they carry the codec's opening ids


@dataclass(frozen=True)
class TalkerPrompt:
    """The Talker's prefill rows and what its decode steps add (see the module docstring).

    Row i's text part is `text_ids[i]` projected, unless i is in `media_rows`: then the
    Thinker's hidden state at prompt position `media_positions[k]` (k: i's index in
    `media_rows`). Its codec part is `codec_ids[i]` (NO_CODEC: none)."""

    text_ids: tuple[int, ...]
    codec_ids: tuple[int, ...]
    media_rows: tuple[int, ...]
    media_positions: tuple[int, ...]
    trailing_ids: tuple[int, ...]     # the text of decode steps 0, 1, ... known so far (`trailing_id`)
    rope_ids: tuple[int, ...]         # what the rotary positions read: the user rows' ids, then tts_pad

    def __len__(self) -> int:
        return len(self.text_ids)


def user_turn_positions(prompt_ids: Sequence[int], tokens: TalkerPromptTokens) -> list[int]:
    """Positions of the prompt that belong to user turns: the role after the last
    <|im_start|> at or before a position is `user` (transformers' `user_mask`; before any
    <|im_start|> it reads the prompt's second id, as transformers' clamped index does)."""
    positions, role = [], prompt_ids[1] if len(prompt_ids) > 1 else None
    for position, token in enumerate(prompt_ids):
        if token == tokens.im_start:
            role = prompt_ids[position + 1] if position + 1 < len(prompt_ids) else None
        if role == tokens.user:
            positions.append(position)
    return positions


def _media_ids(config: TalkerConfig) -> set[int]:
    return {config.media.audio, config.media.image, config.media.video}


def media_positions(prompt_ids: Sequence[int], config: TalkerConfig) -> tuple[int, ...]:
    """The prompt positions whose Thinker hidden states the Talker reads: the media
    placeholders of user turns (`TalkerPrompt.media_positions` of any answer to this prompt)."""
    media = _media_ids(config)
    return tuple(p for p in user_turn_positions(prompt_ids, config.prompt) if prompt_ids[p] in media)


def assistant_start(prompt_ids: Sequence[int], tokens: TalkerPromptTokens) -> int:
    """The position of the last `<|im_start|>assistant` of the prompt: the turn to speak."""
    for position in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[position] == tokens.im_start and prompt_ids[position + 1] == tokens.assistant:
            return position
    raise ValueError("a prompt to speak must end in an assistant turn (<|im_start|>assistant)")


def talker_prompt(prompt_ids: Sequence[int], answer_ids: Sequence[int], speaker: int,
                  config: TalkerConfig) -> TalkerPrompt:
    """The Talker's prompt for the Thinker's `answer_ids` (without the stop token that
    ended it, if one did) to `prompt_ids`, in `speaker`'s voice (a codec id). As transformers, the
    assistant turn is read from its <|im_start|> on, prompt and answer alike: its first 3
    ids open it, the 4th joins the prefill, the rest are the decode steps' text."""
    tokens, codec = config.prompt, config.codec
    start = assistant_start(prompt_ids, tokens)
    turn = list(prompt_ids[start:]) + list(answer_ids)
    if len(turn) < 4:
        raise ValueError("the Talker speaks an answer of at least one token after <|im_start|>assistant\\n")
    user = user_turn_positions(prompt_ids, tokens)
    head = [tokens.tts_pad] * TTS_PADS + [tokens.tts_bos]
    text = [prompt_ids[p] for p in user] + turn[:3] + head + [turn[3]]
    codecs = ([NO_CODEC] * (len(user) + 3)
              + [codec.nothink, codec.think_bos, codec.think_eos, speaker, codec.pad, codec.bos])
    media = _media_ids(config)
    media_rows = tuple(row for row, p in enumerate(user) if prompt_ids[p] in media)
    return TalkerPrompt(
        text_ids=tuple(text), codec_ids=tuple(codecs), media_rows=media_rows,
        media_positions=tuple(user[row] for row in media_rows),
        trailing_ids=tuple(turn[4:]),
        rope_ids=tuple(prompt_ids[p] for p in user) + (tokens.tts_pad,) * (len(text) - len(user)),
    )


def trailing_id(trailing: Sequence[int], step: int, tokens: TalkerPromptTokens, ended: bool = True) -> int:
    """The id whose text part decode step `step` adds: `trailing[step]` (the turn's ids from
    the 5th on, as far as written), then, once the text `ended`, tts_eos and tts_pad."""
    if step < len(trailing):
        return trailing[step]
    if not ended:
        raise ValueError(f"decode step {step} reads the answer's text past what is written ({len(trailing)} ids)")
    return tokens.tts_eos if step == len(trailing) else tokens.tts_pad


# ----------------------------------------------------------------------------- rows (tensors)

def text_rows(talker: Talker, embed_tokens: nn.Embedding, ids: Sequence[int]) -> torch.Tensor:
    """The text parts of `ids`: text_projection of the Thinker's embeddings -> [len(ids), hidden]."""
    return talker.project_text(embed_tokens(torch.tensor(list(ids), dtype=torch.long,
                                                         device=embed_tokens.weight.device)))


def prompt_rows(talker: Talker, embed_tokens: nn.Embedding, prompt: TalkerPrompt,
                media_hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The Talker's prefill input rows [len(prompt), hidden]. `media_hidden`: [m, Ht], the
    Thinker's hidden state `accept_hidden_layer` at `prompt.media_positions`, in order."""
    rows = text_rows(talker, embed_tokens, prompt.text_ids)
    if prompt.media_rows:
        if media_hidden is None or media_hidden.shape[0] != len(prompt.media_rows):
            raise ValueError(f"the Talker's prompt has {len(prompt.media_rows)} media rows; got "
                             f"{None if media_hidden is None else media_hidden.shape[0]} hidden states")
        where = torch.tensor(prompt.media_rows, device=rows.device)
        rows = rows.index_copy(0, where, talker.project_hidden(media_hidden.to(rows.dtype)))
    codec = [(row, c) for row, c in enumerate(prompt.codec_ids) if c != NO_CODEC]
    if codec:
        where = torch.tensor([row for row, _ in codec], device=rows.device)
        ids = torch.tensor([c for _, c in codec], device=rows.device)
        rows = rows.index_add(0, where, talker.embed_codes(ids).to(rows.dtype))
    return rows


def talker_positions(config: TalkerConfig, prompt: TalkerPrompt,
                     image_grids: list[tuple[int, int, int]] = ()) -> PromptPositions:
    """Rotary positions of a Talker prefill (`image_grids`: the merged-patch (t, h, w) grids of
    the user turns' images, in order): row i at position i when no image is among them."""
    media = config.media
    return prompt_positions(list(prompt.rope_ids), media.image, list(image_grids), media.position_id_per_seconds)
