"""Whisper's model config (from `config.json`) and generation config (from `generation_config.json`).

The generation config decides the decoder prompt every window starts from, as
transformers' `WhisperGenerationMixin._retrieve_init_tokens` builds it:

    [<|startofprev|> prompt text ...]  <|startoftranscript|> <|lang|> <|task|> [<|notimestamps|>]
     `previous` (optional)              `init`: the forced tokens

<|notimestamps|> ends the prompt unless the request decodes timestamps: then the model
starts each window with a timestamp token (see timestamps.py).

Multilingual checkpoints take the language from the request or detect it (a decoder
step over <|startoftranscript|>, argmax over the language tokens); English-only ones
(`is_multilingual: false`) use their `forced_decoder_ids` and take neither language nor task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

TASKS = ("transcribe", "translate")


def _language_tables() -> tuple[dict[str, str], dict[str, str]]:
    """transformers' (code -> name, name or alias -> code), imported when first needed."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    return LANGUAGES, TO_LANGUAGE_CODE
DETECT = None     # the language placeholder of `init` while the language is still to be detected


@dataclass(frozen=True)
class WhisperConfig:
    """The shapes of `WhisperForConditionalGeneration`, as its `config.json` names them."""

    vocab_size: int
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    max_source_positions: int = 1500     # encoder positions: 2 mel frames each (conv2 has stride 2)
    max_target_positions: int = 448      # decoder positions: prompt + transcript of one window
    activation_function: str = "gelu"
    tie_word_embeddings: bool = True     # proj_out is embed_tokens
    median_filter_width: int = 7         # word alignment: the cross-attention's smoothing over frames

    def __post_init__(self):
        for name in ("vocab_size", "num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads",
                     "encoder_ffn_dim", "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim",
                     "max_source_positions", "max_target_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for heads in (self.encoder_attention_heads, self.decoder_attention_heads):
            if self.d_model % heads:
                raise ValueError(f"d_model ({self.d_model}) is not a multiple of the head count ({heads})")
        if self.activation_function not in ("gelu", "relu"):
            raise ValueError(f"unsupported activation_function {self.activation_function!r}")

    @property
    def encoder_head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def decoder_head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads

    @property
    def num_frames(self) -> int:
        """Mel frames of one window the encoder takes (3000 for 30 s)."""
        return 2 * self.max_source_positions

    @classmethod
    def from_hf(cls, hf: dict) -> "WhisperConfig":
        names = [f for f in cls.__dataclass_fields__ if f in hf]
        return cls(**{name: hf[name] for name in names})


def tiny_config(vocab_size: int) -> WhisperConfig:
    """`tiny-whisper`: real window sizes (30 s, 448 decoder positions), tiny widths."""
    return WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=80, d_model=64, encoder_layers=2, encoder_attention_heads=4,
        encoder_ffn_dim=256, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=256,
    )


def config_from_hf(hf: dict) -> WhisperConfig:
    return WhisperConfig.from_hf(hf)


@dataclass(frozen=True)
class ForcedPrompt:
    """The decoder prompt of every window of one request (see the module docstring)."""

    previous: tuple[int, ...]          # <|startofprev|> + prompt text ids, or ()
    init: tuple[int | None, ...]       # forced tokens; None (index 1): the language, to be detected
    language: int | None = None        # the language token the request named (None: detected or English-only)
    timestamps: bool = False           # no <|notimestamps|>: the windows are decoded with timestamp tokens

    @property
    def detects_language(self) -> bool:
        return DETECT in self.init

    def ids(self, language: int | None = None) -> list[int]:
        """The prompt ids, with `language` in the placeholder of a detected language."""
        if self.detects_language and language is None:
            raise ValueError("the language is not detected yet")
        return list(self.previous) + [language if t is DETECT else t for t in self.init]

    def __len__(self) -> int:
        return len(self.previous) + len(self.init)


@dataclass(frozen=True)
class WhisperGenerationConfig:
    """What of a Whisper `generation_config.json` decides the prompt and the allowed tokens."""

    decoder_start_token_id: int
    eos_token_ids: frozenset[int]
    suppress_tokens: tuple[int, ...] = ()          # never sampled
    begin_suppress_tokens: tuple[int, ...] = ()    # not sampled at a window's first position
    is_multilingual: bool = False
    lang_to_id: dict[str, int] = field(default_factory=dict)     # "<|en|>" -> id
    task_to_id: dict[str, int] = field(default_factory=dict)     # "transcribe" -> id
    no_timestamps_token_id: int | None = None
    prev_sot_token_id: int | None = None           # <|startofprev|>
    forced_decoder_ids: tuple[tuple[int, int | None], ...] = ()  # old checkpoints: (position, id)
    max_initial_timestamp_index: int | None = None   # the first timestamp of a window is at most this one
    alignment_heads: tuple[tuple[int, int], ...] = ()   # (decoder layer, head): cross-attention that aligns words

    @property
    def timestamp_begin(self) -> int | None:
        """The id of <|0.00|>: every id from here on is a timestamp (0.02 s apart)."""
        return None if self.no_timestamps_token_id is None else self.no_timestamps_token_id + 1

    @property
    def language_ids(self) -> tuple[int, ...]:
        return tuple(self.lang_to_id.values())

    def language_code(self, token_id: int) -> str | None:
        """"en" for the id of <|en|>."""
        for token, tid in self.lang_to_id.items():
            if tid == token_id:
                return token.strip("<|>")
        return None

    def language_to_id(self, language: str) -> int:
        """A code ("en"), a name ("english") or a token ("<|en|>") -> the language token id."""
        key = language.lower().strip()
        _, to_code = _language_tables()
        if key in self.lang_to_id:
            token = key
        elif key in to_code:
            token = f"<|{to_code[key]}|>"
        else:
            token = f"<|{key}|>"
        if token not in self.lang_to_id:
            known = ", ".join(sorted(t.strip("<|>") for t in self.lang_to_id))
            raise ValueError(f"unsupported language {language!r}; this model knows: {known}")
        return self.lang_to_id[token]

    def forced_prompt(self, language: str | None, task: str, previous: tuple[int, ...] = (),
                      timestamps: bool = False) -> ForcedPrompt:
        """The forced tokens as transformers' `_retrieve_init_tokens` builds them."""
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if not self.is_multilingual:
            if language is not None and self._code(language) != "en":
                raise ValueError(f"this model is English-only; got language {language!r}")
            if task != "transcribe":
                raise ValueError("this model is English-only: it cannot translate")
            init: list[int | None] = [self.decoder_start_token_id]
            init += [token for _, token in sorted(self.forced_decoder_ids) if token is not None]
            language_id = None
        else:
            if task not in self.task_to_id:
                raise ValueError(f"the generation config has no task_to_id entry for {task!r}")
            if language is None and not self.lang_to_id:
                raise ValueError("the generation config has no lang_to_id: name the language")
            language_id = self.language_to_id(language) if language is not None else None
            init = [self.decoder_start_token_id, DETECT if language_id is None else language_id, self.task_to_id[task]]
        if timestamps:
            if self.no_timestamps_token_id is None:
                raise ValueError("the generation config has no no_timestamps_token_id: no timestamps can be decoded")
            if init[-1] == self.no_timestamps_token_id:   # an English-only model's forced_decoder_ids
                init.pop()
        elif self.no_timestamps_token_id is not None and init[-1] != self.no_timestamps_token_id:
            init.append(self.no_timestamps_token_id)
        return ForcedPrompt(tuple(previous), tuple(init), language_id, timestamps)

    @staticmethod
    def _code(language: str) -> str:
        key = language.lower().strip().strip("<|>")
        return _language_tables()[1].get(key, key)

    @classmethod
    def from_dict(cls, hf: dict) -> "WhisperGenerationConfig":
        if hf.get("decoder_start_token_id") is None:
            raise ValueError("the generation config has no decoder_start_token_id")
        eos = hf.get("eos_token_id")
        if eos is None:
            raise ValueError("the generation config has no eos_token_id")
        forced = tuple((int(p), t) for p, t in (hf.get("forced_decoder_ids") or ()))
        return cls(
            decoder_start_token_id=hf["decoder_start_token_id"],
            eos_token_ids=frozenset([eos] if isinstance(eos, int) else eos),
            suppress_tokens=tuple(hf.get("suppress_tokens") or ()),
            begin_suppress_tokens=tuple(hf.get("begin_suppress_tokens") or ()),
            is_multilingual=bool(hf.get("is_multilingual", bool(hf.get("lang_to_id")))),
            lang_to_id=dict(hf.get("lang_to_id") or {}),
            task_to_id=dict(hf.get("task_to_id") or {}),
            no_timestamps_token_id=hf.get("no_timestamps_token_id"),
            prev_sot_token_id=hf.get("prev_sot_token_id"),
            forced_decoder_ids=forced,
            max_initial_timestamp_index=hf.get("max_initial_timestamp_index"),
            alignment_heads=tuple((int(layer), int(head)) for layer, head in (hf.get("alignment_heads") or ())),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> "WhisperGenerationConfig":
        """`generation_config.json`; else the same keys in `config.json` (old checkpoints)."""
        for name in ("generation_config.json", "config.json"):
            path = Path(folder) / name
            if path.is_file():
                hf = json.loads(path.read_text())
                if hf.get("decoder_start_token_id") is not None:
                    return cls.from_dict(hf)
        raise FileNotFoundError(f"no Whisper generation config (generation_config.json) in {folder}")


def language_name(code: str | None) -> str | None:
    """"en" -> "english" (the name OpenAI's verbose_json reports)."""
    return _language_tables()[0].get(code) if code else None
