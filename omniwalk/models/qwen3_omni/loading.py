"""What loading Qwen3-Omni's Thinker does differently from the shared pipeline
(omniwalk.loading): the Thinker module (language model, LM head, both encoders), checkpoint
names from either folder kind, a KV cache for the language model, no prefill graphs (a
prefill chunk may carry media rows, which the eager pass binds):

    Qwen3OmniMoeForConditionalGeneration          thinker.X             -> X
                                                  talker.*, code2wav.*  skipped (speech out: not served yet)
    Qwen3OmniMoeThinkerForConditionalGeneration   X                     -> X
"""

from __future__ import annotations

from omniwalk.models.family import LoaderSpec, decoder_kv_layout
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


def serve_thinker(ctx) -> ThinkerModel:
    return ThinkerModel(ctx.module, ctx.cache, max_batch_size=ctx.args.max_num_seqs, decode_graphs=ctx.decode_graphs)


THINKER_LOADER = LoaderSpec(
    build=Thinker,
    rename=checkpoint_name,
    kv_layout=lambda config: decoder_kv_layout(config.text),
    prefill_graphs=False,
    serve=serve_thinker,
)
