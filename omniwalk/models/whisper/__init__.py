"""Whisper speech recognition: an audio encoder feeding a text decoder with cross-attention.

The registry imports this package for the family line; the served model lives in
`model.py` (graph and plan) and `executors.py` (the encoder and decoder nodes), its
loader in `loading.py`, the in-process transcription API in `transcribe.py`.
"""

from omniwalk.models.whisper.config import config_from_hf, tiny_config

__all__ = ["config_from_hf", "tiny_config"]
