"""Qwen3-Omni: the Thinker (audio, images and text in; text out) and, in a full checkpoint,
the Talker, its code predictor and Code2Wav (the answer spoken, 24 kHz).

    config.py            ThinkerConfig from a qwen3_omni_moe checkpoint (full or thinker-only), tiny config
    encoder_config.py    the audio and vision encoders' configs
    audio_encoder.py     Whisper-like windowed audio encoder (`audio_tower.*`)
    vision_encoder.py    ViT with deepstack outputs (`visual.*`)
    thinker.py           the MoE language model with multimodal rotary positions
    positions.py         a prompt's (t, h, w) rotary positions
    media.py             decoding and preprocessing of images and audio (API side)
    executors.py         the nodes: audio encoder, vision encoder, language model
    talker_config.py     the Talker's and code predictor's configs
    talker.py            the Talker: MoE decoder (shared experts), Thinker projections, codec head
    code_predictor.py    the code predictor: a frame's residual codes, inside each Talker step
    talker_prompt.py     the Talker's prompt and per-step text, laid out from the Thinker's ids
    code2wav_config.py   Code2Wav's config
    code2wav.py          codec frames -> waveform, whole or in exact left-context chunks
    speech_executors.py  the nodes: talker, code2wav
    omni.py              the full checkpoint's module (thinker, talker, code2wav)
    model.py             walks, plans, served model
    frontend.py          text generation with media in the prompt, spoken answers
    loading.py           the loader spec
"""

from __future__ import annotations

from omniwalk.models.family import ModelFamily
from omniwalk.models.qwen3_omni.config import (
    ThinkerConfig, check_tensor_parallel_split, thinker_config_from_hf, tiny_config,
)
from omniwalk.models.qwen3_omni.frontend import thinker_frontends, thinker_warmup
from omniwalk.models.qwen3_omni.loading import THINKER_LOADER
from omniwalk.models.qwen3_omni.model import thinker_nodes

FAMILY = ModelFamily("qwen3-omni", ("qwen3_omni_moe", "qwen3_omni_moe_thinker"), thinker_config_from_hf, tiny_config,
                     THINKER_LOADER, frontends=thinker_frontends, warmup=thinker_warmup, nodes=thinker_nodes,
                     tensor_parallel=check_tensor_parallel_split)

__all__ = ["FAMILY", "ThinkerConfig"]
