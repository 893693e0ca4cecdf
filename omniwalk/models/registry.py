"""Model families and built-in tiny models, by name.

A family is one folder under `omniwalk/models/` exporting a `ModelFamily`
(omniwalk.models.family); adding one touches nothing else but a line here, or, for a
family that lives outside the package (a plugin, a test), a call to `register`.
"""

from __future__ import annotations

from pathlib import Path

from omniwalk.models import decoder_lm, orpheus, qwen3_5, qwen3_omni, whisper
from omniwalk.models.family import ModelFamily

TINY_TOKENIZER = Path(__file__).parent / "assets" / "tiny-tokenizer"

FAMILIES: dict[str, ModelFamily] = {}
BUILTIN_MODELS: dict[str, str] = {}   # `tiny-<family>` -> family name


def register(family: ModelFamily) -> None:
    """Makes `family` loadable: its built-in `tiny-<name>` and checkpoints of its model types."""
    if family.name in FAMILIES:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    FAMILIES[family.name] = family
    BUILTIN_MODELS[f"tiny-{family.name}"] = family.name


def unregister(name: str) -> None:
    FAMILIES.pop(name)
    BUILTIN_MODELS.pop(f"tiny-{name}")


for _family in (decoder_lm.QWEN3, decoder_lm.LLAMA, qwen3_5.FAMILY, orpheus.FAMILY, whisper.FAMILY, qwen3_omni.FAMILY):
    register(_family)
_BUILT_IN = frozenset(FAMILIES)


def runtime_registered_families() -> list[tuple[str, str]]:
    """The families `register`ed from outside the package, as (module, attribute) where a
    loaded module holds each: how an engine process (a fresh interpreter) registers them too.
    A family that no module holds is left out, with a warning."""
    import logging
    import sys

    found = []
    for name, family in FAMILIES.items():
        if name in _BUILT_IN:
            continue
        where = next(((module_name, attribute) for module_name, module in list(sys.modules.items())
                      if module_name != "__main__" and module is not None
                      for attribute, value in list(vars(module).items()) if value is family), None)
        if where is None:
            logging.getLogger(__name__).warning("model family %r is held by no module: an engine process "
                                                "cannot load it (use EngineArgs(engine_process=False))", name)
        else:
            found.append(where)
    return found


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
