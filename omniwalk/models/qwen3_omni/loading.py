"""What loading Qwen3-Omni's Thinker does differently from the shared pipeline
(omniwalk.loading): the Thinker module (language model, LM head, both encoders), checkpoint
names from either folder kind, a KV cache for the language model, no prefill graphs (a
prefill chunk may carry media rows, which the eager pass binds):

    Qwen3OmniMoeForConditionalGeneration          thinker.X             -> X
                                                  talker.*, code2wav.*  skipped (speech out: not served yet)
    Qwen3OmniMoeThinkerForConditionalGeneration   X                     -> X
"""

from __future__ import annotations

import dataclasses
import json

from omniwalk.loading import read_model_source
from omniwalk.models.family import LoaderSpec, decoder_kv_layout
from omniwalk.models.qwen3_omni.media import AudioSettings, ImageSettings
from omniwalk.models.qwen3_omni.model import ThinkerModel
from omniwalk.models.qwen3_omni.thinker import Thinker

THINKER_PREFIX = "thinker."
SKIPPED_PREFIXES = ("talker.", "code2wav.")


def checkpoint_name(config, name: str) -> str | None:
    """Parameter name of a checkpoint tensor, or None for the parts the Thinker does not use."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith(THINKER_PREFIX):
        return name[len(THINKER_PREFIX):]
    return name


def read_thinker_source(ctx) -> None:
    """The shared source, then the folder's `preprocessor_config.json` (image resizing
    bounds, normalization, mel settings), if it has one."""
    read_model_source(ctx)
    path = ctx.folder / "preprocessor_config.json" if ctx.folder is not None else None
    if path is None or not path.is_file():
        return
    settings = json.loads(path.read_text())
    image = ctx.config.image_settings
    image = ImageSettings.from_preprocessor_config({"patch_size": image.patch_size, "merge_size": image.merge_size,
                                                     "temporal_patch_size": image.temporal_patch_size, **settings})
    ctx.config = dataclasses.replace(ctx.config, image_settings=image,
                                     audio_settings=AudioSettings.from_preprocessor_config(settings))


def serve_thinker(ctx) -> ThinkerModel:
    return ThinkerModel(ctx.module, ctx.cache, max_batch_size=ctx.args.max_num_seqs, decode_graphs=ctx.decode_graphs,
                        prefill_graphs=ctx.prefill_graphs)


THINKER_LOADER = LoaderSpec(
    build=Thinker,
    read_source=read_thinker_source,
    rename=checkpoint_name,
    kv_layout=lambda config: decoder_kv_layout(config.text),
    serve=serve_thinker,
)
