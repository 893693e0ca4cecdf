"""The Talker's inputs from the Thinker's, exactly as transformers'
`Qwen3OmniMoeForConditionalGeneration.generate` builds them (one request).

The Thinker's sequence: its prompt, which ends with the generation prompt
`<|im_start|>assistant\\n`, then its reply r0 r1 ... r{n-1} (r{n-1}: `<|im_end|>` when it stopped):

    <|im_start|>system ... <|im_start|>user ... <|audio_pad|> x A ... <|im_end|>\\n <|im_start|>assistant \\n r0 r1 ...
                           \\------------------ user turn ------------------/     a           a+1       a+2 a+3

Talker prompt = user part ++ assistant part.

User part: every row of every user turn (a turn runs from its `<|im_start|>` to the row
before the next `<|im_start|>`; system and earlier assistant turns are left out), in order:
    text row    text_projection(E[id])       E: the Thinker's token embedding table
    media row   hidden_projection(H_k[row])  media: the audio, image and video token ids;
                                             H_k: the Thinker's hidden state k = accept_hidden_layer
                                             (k = 0: its layer-0 input; k >= 1: the output of
                                             layer k-1, before any deepstack add) at that row

Assistant part, 9 rows, from a = the last `<|im_start|>` followed by `assistant`:

    row   text side: text_projection(E[.])     codec side: codec_embedding(.)
    0     <|im_start|>   (seq[a])              0 (no codec input)
    1     assistant      (seq[a+1])            0
    2     \\n             (seq[a+2])            0
    3     tts_pad                              codec_nothink
    4     tts_pad                              codec_think_bos
    5     tts_pad                              codec_think_eos
    6     tts_pad                              the voice's speaker id
    7     tts_bos                              codec_pad
    8     r0             (seq[a+3])            codec_bos

Rotary positions come from the rope ids: the user part's Thinker ids, then `tts_pad` x 9.
With no image among them every row i is at position i; with images, `prompt_positions`
over those ids with the Talker's image id, the user turns' image grids and its
`position_id_per_seconds`, and decode steps continue after the largest position (the rope
offset), as the Thinker's.

Decode step k = 0, 1, 2, ... (the Talker's (k+1)-th token) takes as input the summed
embedding of the previous frame's G codes plus the text row T[k]:

    T[k] = text_projection(E[r{k+1}])   for k + 1 <= n - 2
           tts_eos                      for k = n - 2, i.e. once the reply is spoken
           tts_pad                      for every step after

So the reply's last token never reaches the Talker: HF's Thinker never ran it, so it has
no embedding row (`<|im_end|>` after a stop; after a length cut, the last text token).

Where transformers itself fails, and these functions do what it means:
- a reply of one token (n = 1): no r0 row in HF's Thinker states for the prefill;
- a user turn with audio and an image: the Talker's `get_rope_index` reads
  `config.audio_config`, which the Talker's config lacks (audio rows take plain positions,
  as the Thinker's);
- an image outside the user turns: HF still hands the Talker every image's grid, so the grids
  no longer match the images among its rope ids (pass only the user turns' grids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from omniwalk.models.qwen3_omni.positions import PromptPositions, prompt_positions
from omniwalk.models.qwen3_omni.talker import Talker
from omniwalk.models.qwen3_omni.talker_config import TalkerConfig, TalkerPromptTokens

ASSISTANT_PREFIX = 3        # <|im_start|> assistant \n: rows the Talker reads as text only
TTS_PADS = 4                # tts_pad rows under the codec's think markers and the speaker id


@dataclass(frozen=True)
class TalkerPrompt:
    """A Talker prefill: its rows and the ids its rotary positions are computed from."""

    inputs_embeds: torch.Tensor   # [T, hidden]
    rope_ids: list[int]           # [T]: user-part Thinker ids, then tts_pad ids


@dataclass(frozen=True)
class TtsEmbeds:
    """The projected text-side markers, each [hidden]."""

    bos: torch.Tensor
    eos: torch.Tensor    # the text row once the reply is spoken
    pad: torch.Tensor    # every text row after that


def user_rows(ids: Sequence[int], prompt: TalkerPromptTokens) -> list[int]:
    """Indices of the rows of user turns: a row belongs to the turn of the last `<|im_start|>`
    at or before it, whose role is the token after that `<|im_start|>` (HF's rule, including
    its fallback for rows before any `<|im_start|>`: the role is then ids[1])."""
    rows, role = [], ids[min(1, len(ids) - 1)] if ids else None
    for index, token in enumerate(ids):
        if token == prompt.im_start:
            role = ids[min(index + 1, len(ids) - 1)]
        if role == prompt.user:
            rows.append(index)
    return rows


def assistant_start(ids: Sequence[int], prompt: TalkerPromptTokens) -> int:
    """The index of the last `<|im_start|>` followed by `assistant`; ValueError if none."""
    for index in range(len(ids) - 2, -1, -1):
        if ids[index] == prompt.im_start and ids[index + 1] == prompt.assistant:
            return index
    raise ValueError("the Thinker's prompt has no '<|im_start|>assistant' turn for the Talker to speak")


def media_ids(config: TalkerConfig) -> tuple[int, int, int]:
    return config.media.audio, config.media.image, config.media.video


def tts_embeds(talker: Talker, embed_tokens: nn.Embedding) -> TtsEmbeds:
    """text_projection of the Thinker's embeddings of tts_bos, tts_eos, tts_pad (once per model)."""
    prompt = talker.config.prompt
    ids = torch.tensor([prompt.tts_bos, prompt.tts_eos, prompt.tts_pad], device=embed_tokens.weight.device)
    bos, eos, pad = talker.project_text(embed_tokens(ids))
    return TtsEmbeds(bos=bos, eos=eos, pad=pad)


def build_talker_prompt(talker: Talker, embed_tokens: nn.Embedding, prompt_ids: Sequence[int],
                        first_reply_id: int, media_hidden: torch.Tensor, speaker_id: int,
                        tts: TtsEmbeds) -> TalkerPrompt:
    """The Talker's prefill for one request.

    embed_tokens: the Thinker's token embedding table. prompt_ids: the Thinker's prompt;
    first_reply_id: r0, its first sampled token. media_hidden: [m, Ht], the Thinker's hidden
    state `accept_hidden_layer` at the prompt's m media rows (audio, image, video ids), in
    order; those outside user turns are not read. speaker_id: `config.speaker_id(voice)`.
    """
    config = talker.config
    start = assistant_start(prompt_ids, config.prompt)
    sequence = list(prompt_ids) + [first_reply_id]
    head = torch.tensor(sequence[start : start + ASSISTANT_PREFIX + 1], device=embed_tokens.weight.device)
    if head.shape[0] < ASSISTANT_PREFIX + 1:
        raise ValueError("the assistant turn of the Thinker's prompt is cut short")
    user = user_rows(prompt_ids, config.prompt)
    user_part = _user_part(talker, embed_tokens, prompt_ids, media_hidden, user)
    assistant_part = _assistant_part(talker, embed_tokens(head), speaker_id, tts)
    rope_ids = [prompt_ids[row] for row in user] + [config.prompt.tts_pad] * assistant_part.shape[0]
    return TalkerPrompt(inputs_embeds=torch.cat((user_part, assistant_part)), rope_ids=rope_ids)


def _user_part(talker: Talker, embed_tokens: nn.Embedding, prompt_ids: Sequence[int], media_hidden: torch.Tensor,
               user: list[int]) -> torch.Tensor:
    """[len(user), hidden]: text rows through text_projection, media rows through hidden_projection."""
    media = set(media_ids(talker.config))
    media_index = {row: i for i, row in enumerate(r for r, token in enumerate(prompt_ids) if token in media)}
    if media_hidden.shape[0] != len(media_index):
        raise ValueError(f"media_hidden has {media_hidden.shape[0]} rows for the prompt's "
                         f"{len(media_index)} media rows")
    device = embed_tokens.weight.device
    is_media = torch.tensor([row in media_index for row in user], dtype=torch.bool, device=device)
    out = embed_tokens.weight.new_empty((len(user), talker.config.text.hidden_size))
    text_ids = [prompt_ids[row] for row in user if row not in media_index]
    if text_ids:
        out[~is_media] = talker.project_text(embed_tokens(torch.tensor(text_ids, device=device)))
    if bool(is_media.any()):
        hidden_rows = [media_index[row] for row in user if row in media_index]
        out[is_media] = talker.project_hidden(media_hidden[hidden_rows].to(out.dtype))
    return out


def _assistant_part(talker: Talker, head_embeds: torch.Tensor, speaker_id: int, tts: TtsEmbeds) -> torch.Tensor:
    """The 9 assistant rows from the Thinker's embeddings of <|im_start|> assistant \\n r0."""
    codec = talker.config.codec
    projected = talker.project_text(head_embeds)                                   # [4, hidden]
    text_side = torch.cat((projected[:ASSISTANT_PREFIX], tts.pad.expand(TTS_PADS, -1), tts.bos[None],
                           projected[ASSISTANT_PREFIX:]))
    codec_ids = torch.tensor([codec.nothink, codec.think_bos, codec.think_eos, speaker_id, codec.pad, codec.bos],
                             device=head_embeds.device)
    codec_side = torch.cat((projected.new_zeros(ASSISTANT_PREFIX, projected.shape[1]), talker.embed_codes(codec_ids)))
    return text_side + codec_side


def trailing_text(talker: Talker, embed_tokens: nn.Embedding, reply_ids: Sequence[int],
                  tts: TtsEmbeds) -> torch.Tensor:
    """The text rows of the decode steps of a finished reply r0 .. r{n-1} -> [n - 1, hidden]:
    r1 .. r{n-2}, then tts_eos. Step k takes row k; past the end, tts.pad."""
    middle = torch.tensor(list(reply_ids[1:-1]), dtype=torch.long, device=embed_tokens.weight.device)
    return torch.cat((talker.project_text(embed_tokens(middle)), tts.eos[None]))


def talker_positions(config: TalkerConfig, prompt: TalkerPrompt,
                     image_grids: list[tuple[int, int, int]] = ()) -> PromptPositions:
    """Rotary positions of a Talker prefill; image_grids: the (t, h, w) merged-patch grids of
    the images in user turns, in order."""
    media = config.media
    return prompt_positions(prompt.rope_ids, media.image, list(image_grids), media.position_id_per_seconds)
