"""Llama models: `omniwalk.layers.transformer.CausalLM` with a Llama config."""

from omniwalk.models.llama.config import config_from_hf, tiny_config

__all__ = ["config_from_hf", "tiny_config"]
