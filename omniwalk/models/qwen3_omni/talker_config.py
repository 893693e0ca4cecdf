"""Qwen3-Omni's Talker and code predictor: their configs from a full `qwen3_omni_moe`
config.json (`talker_config`, plus the chat-template token ids at the top level).

The Talker is a small Qwen3-MoE decoder whose every layer has a shared expert beside the
routed ones; it reads projected Thinker states and writes one codec frame per step: its
head gives the frame's first code, and the code predictor (a small dense Qwen3 decoder)
fills the other `num_code_groups - 1` codes of the frame, one per tiny step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniwalk.layers.config import DecoderConfig, decoder_config_from_hf

#: HF's `generate` never lets the Talker's first code be one of the last 1,024 ids of its
#: vocabulary (the codec's special ids live there), except codec EOS
SUPPRESSED_TAIL = 1024


@dataclass(frozen=True, kw_only=True)
class CodecTokens:
    """Ids in the Talker's codec vocabulary that frame a reply (`talker_config.codec_*`)."""

    eos: int             # codec_eos_token_id: the Talker's first code that ends the audio
    nothink: int
    think_bos: int
    think_eos: int
    pad: int
    bos: int

    def ids(self) -> tuple[int, ...]:
        return (self.eos, self.nothink, self.think_bos, self.think_eos, self.pad, self.bos)


@dataclass(frozen=True, kw_only=True)
class TalkerPromptTokens:
    """Thinker-vocabulary ids the Talker's prompt is cut and framed by (the top level of a
    full config.json). Defaults: Qwen3-Omni's."""

    im_start: int = 151644
    im_end: int = 151645
    system: int = 8948
    user: int = 872
    assistant: int = 77091
    tts_pad: int = 151671
    tts_bos: int = 151672
    tts_eos: int = 151673


@dataclass(frozen=True, kw_only=True)
class TalkerMediaTokens:
    """What the Talker's multimodal rotary positions read (`talker_config`): the ids of
    media tokens in its prompt ids and the time scale of image positions. Defaults: the
    Qwen3-Omni-30B-A3B checkpoint's (`from_hf` falls back to transformers' class defaults)."""

    audio: int = 151675
    image: int = 151655
    video: int = 151656
    vision_start: int = 151652
    audio_start: int = 151669
    position_id_per_seconds: int = 13
    spatial_merge_size: int = 2


@dataclass(frozen=True, kw_only=True)
class CodePredictorConfig:
    """The dense decoder that fills codes 1 .. G-1 of a frame (`code_predictor_config`)."""

    decoder: DecoderConfig     # Qwen3 layout (QK norm, gated MLP); vocab_size: one codebook's size
    num_code_groups: int       # G: codes per frame, the Talker's first one included

    def __post_init__(self):
        if self.num_code_groups < 2:
            raise ValueError(f"num_code_groups must be >= 2, got {self.num_code_groups}")

    @property
    def max_len(self) -> int:
        """Tokens of one frame's sequence: the Talker's hidden, then codes 0 .. G-2."""
        return self.num_code_groups

    @staticmethod
    def from_hf(hf: dict[str, Any], num_code_groups: int = 32) -> "CodePredictorConfig":
        """From a `code_predictor_config` dict; `num_code_groups`: the Talker's, if the dict lacks it."""
        decoder, _ = text_decoder_from_hf(hf, "code predictor")
        return CodePredictorConfig(decoder=decoder, num_code_groups=hf.get("num_code_groups", num_code_groups))


@dataclass(frozen=True, kw_only=True)
class TalkerConfig:
    text: DecoderConfig            # attention stack, rope theta; intermediate_size: the projections' width
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    # rotary frequency pairs that take height and width positions, interleaved (as the Thinker's)
    mrope_section: tuple[int, int, int]
    thinker_hidden_size: int       # input width of text_projection and hidden_projection
    accept_hidden_layer: int       # Thinker hidden-state index read at media rows (0: its embeddings)
    num_code_groups: int
    codec: CodecTokens
    speakers: dict[str, int] = field(default_factory=dict)   # lower-case voice name -> codec id
    prompt: TalkerPromptTokens = TalkerPromptTokens()
    media: TalkerMediaTokens = TalkerMediaTokens()
    code_predictor: CodePredictorConfig

    def __post_init__(self):
        if sum(self.mrope_section) != self.text.rotary_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to rotary_dim / 2 "
                             f"= {self.text.rotary_dim // 2}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts], got {self.num_experts_per_tok}")
        if self.code_predictor.num_code_groups != self.num_code_groups:
            raise ValueError(f"the code predictor has {self.code_predictor.num_code_groups} code groups, "
                             f"the Talker {self.num_code_groups}")
        if self.code_predictor.decoder.hidden_size != self.text.hidden_size:
            # the Talker's hidden state is the code predictor's first input, and the embeddings
            # of both are summed into the Talker's next input
            raise ValueError("the code predictor's hidden_size must equal the Talker's")
        ids = self.codec.ids() + tuple(self.speakers.values())
        if not all(0 <= i < self.text.vocab_size for i in ids):
            raise ValueError(f"codec ids {ids} must lie in the Talker's vocabulary of {self.text.vocab_size}")
        if self.accept_hidden_layer < 0:
            raise ValueError(f"accept_hidden_layer must be >= 0, got {self.accept_hidden_layer}")
        # a private copy: the caller's dict can no longer change a frozen config
        object.__setattr__(self, "speakers", {name.lower(): i for name, i in self.speakers.items()})

    def speaker_id(self, voice: str) -> int:
        """The codec id of a voice, case-insensitive; KeyError naming the voices otherwise."""
        try:
            return self.speakers[voice.lower()]
        except KeyError:
            raise KeyError(f"unknown voice {voice!r}; this model has {sorted(self.speakers)}") from None

    @property
    def suppressed_codec_ids(self) -> tuple[int, ...]:
        """First codes `generate` never picks: the vocabulary's last 1,024 ids but codec EOS."""
        start = max(0, self.text.vocab_size - SUPPRESSED_TAIL)
        return tuple(i for i in range(start, self.text.vocab_size) if i != self.codec.eos)

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> "TalkerConfig":
        """From a full `qwen3_omni_moe` config.json dict (its `talker_config` and the chat
        token ids at the top level)."""
        return talker_config_from_hf(hf)


def text_decoder_from_hf(sub: dict[str, Any], what: str) -> tuple[DecoderConfig, dict]:
    """DecoderConfig of a text sub-config with the rope type checked (mrope reads as default
    rope, its sections apart); also the rope dict as read."""
    sub = dict(sub)
    rope = dict(sub.get("rope_parameters") or sub.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported for the Qwen3-Omni {what}")
    sub["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", sub.get("rope_theta", 1e6))}
    sub.pop("rope_scaling", None)
    if sub.get("sliding_window") and sub.get("use_sliding_window"):
        raise ValueError(f"sliding-window attention is not supported (the {what})")
    return decoder_config_from_hf(sub, qk_norm=True), rope


def talker_config_from_hf(hf: dict[str, Any]) -> TalkerConfig:
    """TalkerConfig from a full `qwen3_omni_moe` config.json dict (or a bare talker_config dict:
    the chat token ids then take Qwen3-Omni's values)."""
    talker = hf.get("talker_config", hf)
    text_hf = talker["text_config"]
    text, rope = text_decoder_from_hf(text_hf, "Talker")
    num_code_groups = talker.get("num_code_groups", 32)
    prompt_defaults = TalkerPromptTokens()
    return TalkerConfig(
        text=text,
        num_experts=text_hf.get("num_experts", text_hf.get("num_local_experts", 128)),
        num_experts_per_tok=text_hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=text_hf.get("moe_intermediate_size", 384),
        shared_expert_intermediate_size=text_hf["shared_expert_intermediate_size"],
        norm_topk_prob=text_hf.get("norm_topk_prob", False),
        mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
        thinker_hidden_size=talker.get("thinker_hidden_size", 2048),
        accept_hidden_layer=talker.get("accept_hidden_layer", 18),
        num_code_groups=num_code_groups,
        codec=CodecTokens(
            eos=talker.get("codec_eos_token_id", 4198), nothink=talker.get("codec_nothink_id", 4203),
            think_bos=talker.get("codec_think_bos_id", 4204), think_eos=talker.get("codec_think_eos_id", 4205),
            pad=talker.get("codec_pad_id", 4196), bos=talker.get("codec_bos_id", 4197),
        ),
        speakers=dict(talker.get("speaker_id") or {}),
        prompt=TalkerPromptTokens(**{
            name: hf.get(f"{name}_token_id", getattr(prompt_defaults, name))
            for name in ("im_start", "im_end", "system", "user", "assistant", "tts_pad", "tts_bos", "tts_eos")}),
        media=TalkerMediaTokens(
            audio=talker.get("audio_token_id", 151646), image=talker.get("image_token_id", 151655),
            video=talker.get("video_token_id", 151656), vision_start=talker.get("vision_start_token_id", 151652),
            audio_start=talker.get("audio_start_token_id", 151669),
            position_id_per_seconds=talker.get("position_id_per_seconds", 25),
            spatial_merge_size=talker.get("spatial_merge_size", 2),
        ),
        code_predictor=CodePredictorConfig.from_hf(talker["code_predictor_config"], num_code_groups),
    )


def tiny_talker_config(thinker_hidden_size: int = 64, prompt: TalkerPromptTokens | None = None,
                       media: TalkerMediaTokens | None = None) -> TalkerConfig:
    """A tiny Talker (4 experts, top 2, a shared expert; 4 code groups) for tests and CPU demos.

    `prompt` / `media`: the tiny Thinker's ids of the chat and media tokens (they depend on
    its tokenizer); Qwen3-Omni's when None."""
    hidden = 32
    codebook_size = 64
    text = DecoderConfig(
        # as in the real model, the first code's vocabulary is one codebook plus a tail of
        # 1,024 special ids that generation suppresses (codec EOS aside)
        vocab_size=codebook_size + SUPPRESSED_TAIL, hidden_size=hidden, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
        max_position_embeddings=4096,
    )
    predictor = DecoderConfig(
        vocab_size=codebook_size, hidden_size=hidden, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True, max_position_embeddings=64,
    )
    return TalkerConfig(
        text=text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        norm_topk_prob=True, mrope_section=(2, 1, 1), thinker_hidden_size=thinker_hidden_size, accept_hidden_layer=1,
        num_code_groups=4,
        # the codec's special ids where the real model has them: past the codebook (2048 + 100 ...)
        codec=CodecTokens(pad=codebook_size + 100, bos=codebook_size + 101, eos=codebook_size + 102,
                          nothink=codebook_size + 107, think_bos=codebook_size + 108, think_eos=codebook_size + 109),
        speakers={"chelsie": codebook_size + 253, "ethan": codebook_size + 254, "aiden": codebook_size + 255},
        prompt=prompt or TalkerPromptTokens(), media=media or TalkerMediaTokens(),
        code_predictor=CodePredictorConfig(decoder=predictor, num_code_groups=4),
    )
