"""Qwen3-Omni, part 1: the Thinker (audio, images and text in; text out).

    config.py          ThinkerConfig from a qwen3_omni_moe checkpoint (full or thinker-only), tiny config
    encoder_config.py  the audio and vision encoders' configs
    audio_encoder.py   Whisper-like windowed audio encoder (`audio_tower.*`)
    vision_encoder.py  ViT with deepstack outputs (`visual.*`)
    thinker.py         the MoE language model with multimodal rotary positions
    positions.py       a prompt's (t, h, w) rotary positions
    media.py           decoding and preprocessing of images and audio (API side)
    executors.py       the nodes: audio encoder, vision encoder, language model
    model.py           walks, plan, served model
    frontend.py        text generation with media in the prompt
    loading.py         the loader spec

Speech out (Talker, code predictor, Code2Wav) is part 2: those checkpoint tensors are skipped.
"""

from __future__ import annotations

from omniwalk.models.family import ModelFamily
from omniwalk.models.qwen3_omni.config import ThinkerConfig, thinker_config_from_hf, tiny_config
from omniwalk.models.qwen3_omni.frontend import thinker_frontends, thinker_warmup
from omniwalk.models.qwen3_omni.loading import THINKER_LOADER

FAMILY = ModelFamily("qwen3-omni", ("qwen3_omni_moe", "qwen3_omni_moe_thinker"), thinker_config_from_hf, tiny_config,
                     THINKER_LOADER, frontends=thinker_frontends, warmup=thinker_warmup)

__all__ = ["FAMILY", "ThinkerConfig"]
