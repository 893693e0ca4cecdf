"""Orpheus text-to-speech: a Llama backbone emitting SNAC audio codes, decoded over a stream edge.

    config.py     token layout, voices, the tiny built-in
    model.py      the served model: graph (codes -> SNAC windows -> audio), plan, executors
    snac*.py      the SNAC decoder and its CUDA graphs
    loading.py    what its loading adds to the shared pipeline (the codec)
    speech.py     the speech frontend, output processor and warm-up requests
"""

from omniwalk.models.decoder_lm.config import llama_config_from_hf
from omniwalk.models.family import ModelFamily
from omniwalk.models.orpheus.config import is_orpheus_config, tiny_backbone_config
from omniwalk.models.orpheus.loading import ORPHEUS_LOADER
from omniwalk.models.orpheus.model import orpheus_nodes
from omniwalk.models.orpheus.speech import speech_frontends, speech_warmup

FAMILY = ModelFamily("orpheus", (), llama_config_from_hf, tiny_backbone_config, ORPHEUS_LOADER,
                     frontends=speech_frontends, warmup=speech_warmup, detect=is_orpheus_config,
                     quantizations=("fp8",), nodes=orpheus_nodes)

__all__ = ["FAMILY"]
