"""Whisper speech recognition: an audio encoder feeding a text decoder with cross-attention.

    config.py       model and generation configs (forced prompt, languages, suppression)
    features.py     log-mel frames of a recording, and its 30 s windows at a seek
    modeling.py     the encoder and decoder modules
    model.py        the served model: graph (encode, prefill, decode), plan
    executors.py    the encoder and decoder nodes
    timestamps.py   timestamp tokens: what may be sampled, a window's segments, the next seek
    fallback.py     the temperature fallback's checks
    alignment.py    token times by cross-attention alignment (word timestamps)
    loading.py      what its loading adds to the shared pipeline (cross-attention slots)
    transcribe.py   the transcription frontend, output processor and warm-up requests
"""

from omniwalk.models.family import ModelFamily
from omniwalk.models.whisper.config import config_from_hf, tiny_config
from omniwalk.models.whisper.loading import WHISPER_LOADER
from omniwalk.models.whisper.model import whisper_nodes
from omniwalk.models.whisper.transcribe import transcription_frontends, transcription_warmup

FAMILY = ModelFamily("whisper", ("whisper",), config_from_hf, tiny_config, WHISPER_LOADER,
                     frontends=transcription_frontends, warmup=transcription_warmup,
                     nodes=whisper_nodes)

__all__ = ["FAMILY"]
