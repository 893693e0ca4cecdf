"""Orpheus token layout, voices, and the tiny built-in configuration.

Orpheus (canopylabs/orpheus-3b-0.1-ft) is Llama-3.2-3B with the Llama-3 vocabulary
(128256 ids) followed by its own ids. Written relative to `base` = 128256 (the reference
code calls it `tokeniser_length`):

    id          name              role
    128000      <|begin_of_text|> bos, added by the tokenizer
    128009      <|eot_id|>        ends the text of the prompt
    base + 1    start_of_speech   128257  last prompt id: the model speaks next
    base + 2    end_of_speech     128258  the stop id (EOS of the speech stream)
    base + 3    start_of_human    128259  first prompt id
    base + 4    end_of_human      128260
    base + 5    start_of_ai       128261
    base + 6    end_of_ai         128262  (follows end_of_speech; never reached here)
    base + 10   audio_start       128266  = <custom_token_10>, the first audio code id

    prompt = [start_of_human] + tokenizer(f"{voice}: {text}") + [eot, end_of_human, start_of_ai,
             start_of_speech]                         (the tokenizer adds bos)

Audio codes come in frames of 7 tokens. The token at position i = count % 7 of a frame
carries SNAC code c in [0, 4096) as

    id = audio_start + i * 4096 + c             c = id - 128266 - i * 4096

(the reference writes it as `int(N) - 10 - i * 4096` for `<custom_token_N>`, and
`<custom_token_N>` = base + N). One frame feeds SNAC's three levels as

    frame:     c0  c1  c2  c3  c4  c5  c6
    level 0:   c0                               (1 code,  ~12 Hz)
    level 1:       c1          c4               (2 codes, ~23 Hz)
    level 2:           c2  c3      c5  c6       (4 codes, ~47 Hz)

so a frame is 4 latent steps of 512 samples: 2048 samples of 24 kHz audio.

The tiny built-in model keeps this layout with base = 512 (the tiny tokenizer's size),
eot = <|im_end|> (2), no bos, and a 64-entry codebook: audio ids 522 .. 969.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, replace


from omniwalk.layers.config import DecoderConfig
from omniwalk.models.decoder_lm.config import llama_tiny_config
from omniwalk.models.orpheus.snac import SNAC_24KHZ, SnacConfig

CODES_PER_FRAME = 7
# position in the frame -> (SNAC level, index within the frame's codes of that level)
FRAME_LAYOUT = ((0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (2, 2), (2, 3))

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")


@dataclass(frozen=True)
class OrpheusTokens:
    """Special and audio-code ids of an Orpheus checkpoint (see the module docstring)."""

    base: int               # size of the text vocabulary the Orpheus ids follow
    end_of_text: int        # the text tokenizer's end-of-turn id
    codebook_size: int      # SNAC codebook entries per level

    @property
    def start_of_speech(self) -> int:
        return self.base + 1

    @property
    def end_of_speech(self) -> int:
        return self.base + 2

    @property
    def start_of_human(self) -> int:
        return self.base + 3

    @property
    def end_of_human(self) -> int:
        return self.base + 4

    @property
    def start_of_ai(self) -> int:
        return self.base + 5

    @property
    def end_of_ai(self) -> int:
        return self.base + 6

    @property
    def audio_start(self) -> int:
        return self.base + 10

    @property
    def audio_end(self) -> int:
        """One past the last audio-code id."""
        return self.audio_start + CODES_PER_FRAME * self.codebook_size

    @property
    def sampled_ids(self) -> range:
        """Every id the backbone may sample (end_of_speech, then the audio codes): its LM
        head scores these alone."""
        return range(self.end_of_speech, self.audio_end)

    def code_id(self, code: int, position: int) -> int:
        """The token id of SNAC code `code` at frame position `position` (0..6)."""
        return self.audio_start + position * self.codebook_size + code

    def code_of(self, token_id: int, position: int) -> int:
        """SNAC code of `token_id` at frame position `position`; ValueError if it is none."""
        code = token_id - self.audio_start - position * self.codebook_size
        if not 0 <= code < self.codebook_size:
            raise ValueError(f"token {token_id} is not an audio code for frame position {position}")
        return code

    def codes_of(self, token_ids) -> tuple[int, ...]:
        """`code_of` over ids that start at frame position 0, at once. Plain Python: a
        window is 28 ids, where numpy's per-call overhead costs twice the arithmetic."""
        offsets = itertools.cycle([self.audio_start + p * self.codebook_size for p in range(CODES_PER_FRAME)])
        codes = tuple(map(operator.sub, token_ids, offsets))
        if codes and (min(codes) < 0 or max(codes) >= self.codebook_size):
            first = next(i for i, code in enumerate(codes) if not 0 <= code < self.codebook_size)
            raise ValueError(f"token {token_ids[first]} is not an audio code for frame position "
                             f"{first % CODES_PER_FRAME}")
        return codes

    def prompt_ids(self, text_ids: list[int]) -> list[int]:
        """The prompt around the tokenized `"{voice}: {text}"` (bos included by the tokenizer)."""
        return [self.start_of_human, *text_ids, self.end_of_text, self.end_of_human,
                self.start_of_ai, self.start_of_speech]


ORPHEUS_3B = OrpheusTokens(base=128256, end_of_text=128009, codebook_size=SNAC_24KHZ.codebook_size)

TINY_TOKENS = OrpheusTokens(base=512, end_of_text=2, codebook_size=64)
TINY_VOCAB_SIZE = 976   # audio_end (970) rounded up to a multiple of 16

TINY_SNAC = SnacConfig(
    sampling_rate=24000, encoder_dim=4, encoder_rates=(2, 2, 4), decoder_dim=64, decoder_rates=(4, 2, 2),
    codebook_size=TINY_TOKENS.codebook_size, codebook_dim=4, vq_strides=(4, 2, 1),
)
"""A small SNAC at Orpheus' frame shape: 64 samples per frame (4 latent steps x 16)."""


def tiny_backbone_config(text_vocab_size: int) -> DecoderConfig:
    """The tiny Llama of `tiny-orpheus`: the tiny tokenizer's ids, then TINY_TOKENS' ids."""
    if text_vocab_size != TINY_TOKENS.base:
        raise ValueError(f"tiny-orpheus expects the {TINY_TOKENS.base}-token tiny tokenizer, got {text_vocab_size}")
    return replace(llama_tiny_config(TINY_VOCAB_SIZE), eos_token_ids=(TINY_TOKENS.end_of_speech,))


def is_orpheus_config(hf: dict) -> bool:
    """A Llama `config.json` whose vocabulary holds Orpheus' audio-code ids."""
    return hf.get("model_type") == "llama" and hf.get("vocab_size", 0) >= ORPHEUS_3B.audio_end


def samples_per_frame(snac: SnacConfig) -> int:
    """Audio samples one 7-code frame decodes to (2048 for snac_24khz)."""
    if snac.vq_strides != (4, 2, 1):
        raise ValueError(f"Orpheus frames need SNAC vq_strides (4, 2, 1), got {snac.vq_strides}")
    return snac.vq_strides[0] * snac.hop_length
