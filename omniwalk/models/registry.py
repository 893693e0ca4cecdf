"""Model families and built-in tiny models, by name.

A family is one folder under `omniwalk/models/`; adding one touches nothing else but a
line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from omniwalk.layers.config import DecoderConfig
from omniwalk.models import llama, orpheus, qwen3, qwen3_5, whisper

TINY_TOKENIZER = Path(__file__).parent / "assets" / "tiny-tokenizer"


@dataclass(frozen=True)
class ModelFamily:
    """A model family: how to read its config, its tiny built-in config, and its loader."""

    name: str
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[dict], DecoderConfig]
    tiny_config: Callable[[int], DecoderConfig]
    # "module:function" taking (EngineArgs, family, folder or None) -> LoadedModel; a
    # family with other components (codecs, encoders) names its own loader
    loader: str = "omniwalk.loading:load_text_model"
    # claims a checkpoint folder by its config.json before model types are matched (a
    # family built on another's architecture, e.g. Orpheus on Llama)
    detect: Callable[[dict], bool] | None = None
    # EngineArgs.quantization values its loader applies (`loading.quantize_backbone`)
    quantizations: tuple[str, ...] = ()


FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily("qwen3", ("qwen3",), qwen3.config_from_hf, qwen3.tiny_config, quantizations=("fp8",)),
    "llama": ModelFamily("llama", ("llama",), llama.config_from_hf, llama.tiny_config, quantizations=("fp8",)),
    "qwen3_5": ModelFamily("qwen3_5", ("qwen3_5", "qwen3_5_text"), qwen3_5.config_from_hf, qwen3_5.tiny_config,
                          loader="omniwalk.models.qwen3_5.loading:load_qwen3_5"),
    "orpheus": ModelFamily("orpheus", (), llama.config_from_hf, orpheus.tiny_backbone_config,
                          loader="omniwalk.models.orpheus.loading:load_orpheus", detect=orpheus.is_orpheus_config,
                          quantizations=("fp8",)),
    "whisper": ModelFamily("whisper", ("whisper",), whisper.config_from_hf, whisper.tiny_config,
                          loader="omniwalk.models.whisper.loading:load_whisper"),
}

BUILTIN_MODELS: dict[str, str] = {f"tiny-{name}": name for name in FAMILIES}


def family_for_hf_config(hf: dict) -> ModelFamily:
    """The family of a checkpoint folder's `config.json`: one whose `detect` claims it, else by model_type."""
    for family in FAMILIES.values():
        if family.detect is not None and family.detect(hf):
            return family
    return family_for_model_type(hf.get("model_type", ""))


def family_for_model_type(model_type: str) -> ModelFamily:
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {known}")
