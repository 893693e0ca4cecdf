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

NO_CODEC = -1


@dataclass(frozen=True, kw_only=True)
class SpeechTokens:
    """The ids the Talker's prompt is made of (a `qwen3_omni_moe` config's top level and
    `talker_config`)."""

    im_start: int
    user: int
    assistant: int
    tts_pad: int            # Thinker vocabulary
    tts_bos: int
    tts_eos: int
    codec_nothink: int      # Talker (codec) vocabulary
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    media: frozenset[int]   # the Thinker's audio, image and video placeholders

    @classmethod
    def from_hf(cls, config: dict, media: frozenset[int]) -> "SpeechTokens":
        talker = config["talker_config"]
        return cls(im_start=config["im_start_token_id"], user=config["user_token_id"],
                   assistant=config["assistant_token_id"], tts_pad=config["tts_pad_token_id"],
                   tts_bos=config["tts_bos_token_id"], tts_eos=config["tts_eos_token_id"],
                   codec_nothink=talker["codec_nothink_id"], codec_think_bos=talker["codec_think_bos_id"],
                   codec_think_eos=talker["codec_think_eos_id"], codec_pad=talker["codec_pad_id"],
                   codec_bos=talker["codec_bos_id"], codec_eos=talker["codec_eos_token_id"], media=media)


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
    trailing_ids: tuple[int, ...]     # decode step j adds trailing_ids[j]; past the end: tts_pad

    def __len__(self) -> int:
        return len(self.text_ids)


def user_turn_positions(prompt_ids: list[int], tokens: SpeechTokens) -> list[int]:
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


def assistant_start(prompt_ids: list[int], tokens: SpeechTokens) -> int:
    """The position of the last `<|im_start|>assistant` of the prompt: the turn to speak."""
    for position in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[position] == tokens.im_start and prompt_ids[position + 1] == tokens.assistant:
            return position
    raise ValueError("a prompt to speak must end in an assistant turn (<|im_start|>assistant)")


def talker_prompt(prompt_ids: list[int], answer_ids: list[int], speaker: int, tokens: SpeechTokens) -> TalkerPrompt:
    """The Talker's prompt for the Thinker's `answer_ids` (without the stop token that
    ended it, if one did) to `prompt_ids`, in `speaker`'s voice (a codec id). As transformers, the
    assistant turn is read from its <|im_start|> on, prompt and answer alike: its first 3
    ids open it, the 4th joins the prefill, the rest are the decode steps' text."""
    start = assistant_start(prompt_ids, tokens)
    turn = prompt_ids[start:] + list(answer_ids)
    if len(turn) < 4:
        raise ValueError("the Talker speaks an answer of at least one token after <|im_start|>assistant\\n")
    user = user_turn_positions(prompt_ids, tokens)
    text = [prompt_ids[p] for p in user] + turn[:3] + [tokens.tts_pad] * 4 + [tokens.tts_bos, turn[3]]
    codec = ([NO_CODEC] * (len(user) + 3) + [tokens.codec_nothink, tokens.codec_think_bos, tokens.codec_think_eos,
                                               speaker, tokens.codec_pad, tokens.codec_bos])
    media_rows = tuple(row for row, p in enumerate(user) if prompt_ids[p] in tokens.media)
    return TalkerPrompt(
        text_ids=tuple(text), codec_ids=tuple(codec), media_rows=media_rows,
        media_positions=tuple(user[row] for row in media_rows),
        trailing_ids=tuple(turn[4:]) + (tokens.tts_eos,),
    )


def trailing_id(prompt: TalkerPrompt, step: int, tokens: SpeechTokens) -> int:
    """The id whose text part decode step `step` adds."""
    return prompt.trailing_ids[step] if step < len(prompt.trailing_ids) else tokens.tts_pad
