"""Qwen3-Omni's Thinker: its config from a `qwen3_omni_moe` checkpoint (full or thinker-only).

The Thinker is a Qwen3-MoE decoder (GQA attention with per-head QK norm, sparse expert
MLPs) whose rotary positions are multimodal (time / height / width sections, interleaved),
fed by an audio encoder and a vision encoder. A full checkpoint nests it under
`thinker_config`; a thinker-only folder (`Qwen3OmniMoeThinkerForConditionalGeneration`)
is that dict at the top level.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omniwalk.layers.config import DecoderConfig
from omniwalk.models.qwen3_omni.encoder_config import AudioEncoderConfig, VisionEncoderConfig
from omniwalk.models.qwen3_omni.code2wav_config import Code2WavConfig
from omniwalk.models.qwen3_omni.media import AudioSettings, ImageSettings
from omniwalk.models.qwen3_omni.talker_config import (
    TalkerConfig, TalkerMediaTokens, TalkerPromptTokens, text_decoder_from_hf, tiny_talker_config,
)

#: the text that marks one media item's place in a prompt (Qwen3-Omni's chat template)
MEDIA_MARKER_TOKENS = {
    "image": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "audio": ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"),
}


@dataclass(frozen=True, kw_only=True)
class MediaTokens:
    """The ids of the special tokens that frame and stand for media in a prompt."""

    audio: int              # <|audio_pad|>: one per audio embedding
    image: int              # <|image_pad|>: one per merged image patch
    video: int
    audio_start: int
    audio_end: int
    vision_start: int
    vision_end: int

    def of_marker(self) -> dict[str, int]:
        """Marker token text -> id."""
        return {"<|vision_start|>": self.vision_start, "<|image_pad|>": self.image, "<|vision_end|>": self.vision_end,
                "<|audio_start|>": self.audio_start, "<|audio_pad|>": self.audio, "<|audio_end|>": self.audio_end}


@dataclass(frozen=True)
class SpeechConfig:
    """The speaking parts of a full checkpoint: the Talker (with its code predictor) and Code2Wav."""

    talker: TalkerConfig
    code2wav: Code2WavConfig

    def __post_init__(self):
        predictor = self.talker.code_predictor.decoder
        if (self.code2wav.num_quantizers, self.code2wav.codebook_size) != (self.talker.num_code_groups,
                                                                            predictor.vocab_size):
            raise ValueError(f"Code2Wav reads {self.code2wav.num_quantizers} codebooks of "
                             f"{self.code2wav.codebook_size}; the Talker writes {self.talker.num_code_groups} of "
                             f"{predictor.vocab_size}")


@dataclass(frozen=True, kw_only=True)
class ThinkerConfig:
    text: DecoderConfig                  # attention stack, dense MLP width (mlp_only_layers), rope theta
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # rotary frequency pairs that take the height and width positions, interleaved (t h w t h
    # w ...) as in Qwen3-VL; the first entry counts the time ones (the rest)
    mrope_section: tuple[int, int, int]
    position_id_per_seconds: int = 13    # temporal rotary positions per second of video
    tokens: MediaTokens
    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    # preprocessing (the folder's preprocessor_config.json, read at load; else the defaults)
    image_settings: ImageSettings = ImageSettings()
    audio_settings: AudioSettings = AudioSettings()
    speech: SpeechConfig | None = None   # a full checkpoint's Talker and Code2Wav (None: text out only)

    def __post_init__(self):
        if sum(self.mrope_section) != self.text.rotary_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to rotary_dim / 2 = {self.text.rotary_dim // 2}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts], got {self.num_experts_per_tok}")

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    # what the shared loading pipeline and text frontend read of a decoder config
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.text.eos_token_ids


def check_tensor_parallel_split(config: ThinkerConfig, size: int) -> None:
    """`ModelFamily.tensor_parallel`: raises ValueError naming every size of the Thinker's
    language model that `size` ranks cannot split evenly (heads, KV heads: not replicated
    yet, the experts' intermediate size, the dense MLP's where a layer has one, vocabulary).
    The encoders, Talker and Code2Wav are whole on every rank: nothing of theirs must divide."""
    if size == 1:
        return
    text = config.text
    sizes = {"num_heads": text.num_heads, "num_kv_heads": text.num_kv_heads}
    if config.num_experts > 0:
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    if not all(config.is_sparse(layer) for layer in range(text.num_layers)):
        sizes["intermediate_size"] = text.intermediate_size
    sizes["vocab_size"] = text.vocab_size
    uneven = [f"{name} ({value})" for name, value in sizes.items() if value % size]
    if uneven:
        raise ValueError(f"tensor parallel size {size} does not divide the Thinker's {', '.join(uneven)}: each rank "
                         f"must hold an equal share of its heads, KV heads, experts' and MLP rows and vocabulary")


def thinker_config_from_hf(hf: dict[str, Any]) -> ThinkerConfig:
    """ThinkerConfig from a `qwen3_omni_moe` (full) or `qwen3_omni_moe_thinker` config.json dict."""
    thinker = hf.get("thinker_config", hf)
    text = thinker["text_config"]
    decoder, rope = text_decoder_from_hf(text, "Thinker")
    ids = thinker
    audio = AudioEncoderConfig.from_hf(thinker.get("audio_config") or {})
    vision = VisionEncoderConfig.from_hf(thinker.get("vision_config") or {})
    return ThinkerConfig(
        text=decoder,
        num_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        moe_intermediate_size=text["moe_intermediate_size"],
        norm_topk_prob=text.get("norm_topk_prob", True),
        decoder_sparse_step=text.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
        mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
        position_id_per_seconds=ids.get("position_id_per_seconds", 13),
        tokens=MediaTokens(
            audio=ids.get("audio_token_id", 151646), image=ids.get("image_token_id", 151655),
            video=ids.get("video_token_id", 151656), audio_start=ids.get("audio_start_token_id", 151647),
            audio_end=ids.get("audio_end_token_id", 151648), vision_start=ids.get("vision_start_token_id", 151652),
            vision_end=ids.get("vision_end_token_id", 151653),
        ),
        audio=audio,
        vision=vision,
        image_settings=ImageSettings(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                     merge_size=vision.spatial_merge_size),
        audio_settings=AudioSettings(num_mel_bins=audio.num_mel_bins),
        speech=speech_config_from_hf(hf),
    )


def speech_config_from_hf(hf: dict[str, Any]) -> SpeechConfig | None:
    """The Talker and Code2Wav of a full `qwen3_omni_moe` config.json with audio output on;
    None for a thinker-only one."""
    if not (hf.get("talker_config") and hf.get("code2wav_config") and hf.get("enable_audio_output", True)):
        return None
    return SpeechConfig(TalkerConfig.from_hf(hf), Code2WavConfig.from_hf(hf))


# Media and speech token ids of the tiny model: past the tiny tokenizer's vocabulary (which
# has no such tokens); the frontend maps the marker texts to them.
TINY_MEDIA_TOKENS = 10
# the tiny tokenizer's <|im_start|>, <|im_end|> and the first id of each role's name, as its
# chat template writes them (the Talker finds the turns by the id after <|im_start|>)
TINY_CHAT_IDS = dict(im_start=1, im_end=2, system=85, user=359, assistant=284)


def tiny_config(tokenizer_size: int) -> ThinkerConfig:
    """A tiny Thinker (4 experts, top 2, one dense layer) for tests and CPU demos."""
    base = tokenizer_size
    hidden = 64
    text = DecoderConfig(
        vocab_size=tokenizer_size + TINY_MEDIA_TOKENS, hidden_size=hidden, intermediate_size=96, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
        tie_word_embeddings=False, max_position_embeddings=4096, eos_token_ids=(0,),
    )
    return ThinkerConfig(
        text=text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=(1,), mrope_section=(4, 2, 2), position_id_per_seconds=13,
        tokens=MediaTokens(audio=base, image=base + 1, video=base + 2, audio_start=base + 3, audio_end=base + 4,
                           vision_start=base + 5, vision_end=base + 6),
        audio=AudioEncoderConfig.tiny(output_dim=hidden),
        vision=VisionEncoderConfig.tiny(out_hidden_size=hidden),
        # images of at most 64 x 64 pixels: 4 tokens each
        image_settings=ImageSettings(min_pixels=32 * 32, max_pixels=64 * 64),
        speech=SpeechConfig(
            tiny_talker_config(hidden, TalkerPromptTokens(**TINY_CHAT_IDS, tts_pad=base + 7, tts_bos=base + 8,
                                                          tts_eos=base + 9),
                               TalkerMediaTokens(audio=base, image=base + 1, video=base + 2, vision_start=base + 5,
                                                 audio_start=base + 3)),
            dataclasses.replace(Code2WavConfig.tiny(), codebook_size=64)),
    )
