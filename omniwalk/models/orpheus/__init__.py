"""Orpheus text-to-speech: a Llama backbone emitting SNAC audio codes, decoded over a stream edge.

The registry imports this package for the family line; the served model lives in
`model.py`, its loader in `loading.py`, the in-process speech API in `speech.py`.
"""

from omniwalk.models.orpheus.config import is_orpheus_config, tiny_backbone_config

__all__ = ["is_orpheus_config", "tiny_backbone_config"]
