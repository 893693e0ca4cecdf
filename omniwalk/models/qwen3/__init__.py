"""Qwen3 dense models: `omniwalk.layers.transformer.CausalLM` with a Qwen3 config."""

from omniwalk.models.qwen3.config import config_from_hf, tiny_config

__all__ = ["config_from_hf", "tiny_config"]
