"""What loading Qwen3-Omni does differently from the shared pipeline (omniwalk.loading): the
module (the Thinker alone, or with the Talker and Code2Wav when the config has them),
checkpoint names from either folder kind, a KV cache for the Thinker's language model and,
for a model that speaks, a second one for the Talker:

    Qwen3OmniMoeForConditionalGeneration          thinker.X, talker.X, code2wav.X    (`Qwen3Omni`)
      with audio output off                       thinker.X -> X; talker.*, code2wav.* skipped
    Qwen3OmniMoeThinkerForConditionalGeneration   X                                  (`Thinker`)

A placement may run `talker` and `code2wav` in a worker group (docs/placement.md): the
worker builds them (`worker_talker`, `worker_code2wav`: the whole model, then the Thinker
dropped but its token embeddings, which the Talker's text rows read), and the engine process
drops them and allocates no Talker cache (`speech_resources`).
"""

from __future__ import annotations

import dataclasses
import json

import torch

from omniwalk.loading import build_module, quantize_backbone, read_model_source
from omniwalk.models.family import LoaderSpec, decoder_kv_layout
from omniwalk.models.qwen3_omni.media import AudioSettings, ImageSettings
from omniwalk.engine.kv_cache import KVCacheShape, PagedKVCache
from omniwalk.models.qwen3_omni.config import ThinkerConfig
from omniwalk.models.qwen3_omni.model import CODE2WAV, TALKER, SpeechParts, ThinkerModel
from omniwalk.models.qwen3_omni.omni import Qwen3Omni
from omniwalk.models.qwen3_omni.speech_executors import Code2WavExecutor, TalkerExecutor
from omniwalk.models.qwen3_omni.thinker import Thinker

THINKER_PREFIX = "thinker."
SKIPPED_PREFIXES = ("talker.", "code2wav.")


def build(config: ThinkerConfig):
    return Qwen3Omni(config) if config.speech is not None else Thinker(config)


def checkpoint_name(config: ThinkerConfig, name: str) -> str | None:
    """Parameter name of a checkpoint tensor, or None for the parts the model does not use."""
    if config.speech is not None:
        return name   # Qwen3Omni has transformers' names
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


def thinker_of(ctx) -> Thinker:
    return ctx.module.thinker if isinstance(ctx.module, Qwen3Omni) else ctx.module


#: Talker KV tokens per running request on a GPU (20 KB a token at Qwen3-Omni-30B-A3B's size);
#: the Talker's cache is allocated before the Thinker's takes what memory is left
TALKER_TOKENS_PER_SEQUENCE = 2048


def placed_apart(ctx) -> frozenset[str]:
    """The speaking nodes a placement runs in a worker group: the engine process keeps no
    executor, module or cache of theirs."""
    placement = ctx.args.placement
    return frozenset() if placement is None else frozenset({TALKER.name, CODE2WAV.name} & placement.worker_nodes)


def speech_resources(ctx) -> None:
    """The Talker's KV cache where the Talker runs in this process; the speaking modules a
    worker group runs instead are dropped here (their weights were needed only to draw the
    Thinker's random weights as a whole model's, the same as the worker's)."""
    if ctx.config.speech is None:
        return
    apart = placed_apart(ctx)
    if TALKER.name in apart:
        ctx.module.talker = None
    if CODE2WAV.name in apart:
        ctx.module.code2wav = None
    if apart and ctx.device.type == "cuda":
        torch.cuda.empty_cache()   # their memory goes back to the KV caches' budget
    if TALKER.name not in apart:
        allocate_talker_cache(ctx)


def allocate_talker_cache(ctx) -> None:
    speech = ctx.config.speech
    args, text = ctx.args, speech.talker.text
    tokens = args.kv_cache_tokens or (args.max_num_seqs * TALKER_TOKENS_PER_SEQUENCE if ctx.device.type == "cuda"
                                      else 65536)
    shape = KVCacheShape(text.num_layers, text.num_kv_heads, text.head_dim, args.page_size, -(-tokens // args.page_size))
    ctx.resources["talker_cache"] = PagedKVCache(shape, ctx.dtype, ctx.device)


def talker_executor(ctx, talker, thinker_embeddings) -> TalkerExecutor:
    """Node `talker` over the Talker's KV cache (allocated first); `thinker_embeddings`: the
    Thinker's token embeddings, which the Talker's text rows read (the engine's own table in
    one process, a copy of it in a worker group)."""
    if "talker_cache" not in ctx.resources:
        allocate_talker_cache(ctx)
    return TalkerExecutor(talker, thinker_embeddings, ctx.resources["talker_cache"], ctx.args.max_num_seqs,
                          graphs=not ctx.args.enforce_eager)


def serve_thinker(ctx) -> ThinkerModel:
    speech = None
    if isinstance(ctx.module, Qwen3Omni):
        apart, executors = placed_apart(ctx), {}
        if TALKER.name not in apart:
            executors[TALKER.name] = talker_executor(ctx, ctx.module.talker, thinker_of(ctx).model.embed_tokens)
        if CODE2WAV.name not in apart:
            executors[CODE2WAV.name] = Code2WavExecutor(ctx.module.code2wav)
        speech = SpeechParts(ctx.config.speech, executors)
    return ThinkerModel(thinker_of(ctx), ctx.cache, max_batch_size=ctx.args.max_num_seqs,
                        decode_graphs=ctx.decode_graphs, prefill_graphs=ctx.prefill_graphs, speech=speech)


# ----------------------------------------------------------------- a worker group's speaking nodes


def speaking_module(ctx) -> Qwen3Omni:
    """The model a worker group's `talker` and `code2wav` run from, built once for both: the
    whole model, as the engine process builds it (random weights are drawn over all of it, so
    the Talker's and Code2Wav's equal the engine's), then the Thinker dropped but its token
    embeddings (the Talker's text rows read them: a read-only table, copied rather than
    shared across processes)."""
    module = ctx.resources.get("speaking_module")
    if module is not None:
        return module
    if ctx.config.speech is None:
        raise ValueError(f"{ctx.args.model} has no Talker: its config does not speak")
    spec = ctx.family.loader
    ctx.module = build_module(lambda: build(ctx.config), ctx.device, ctx.dtype, ctx.random_weights, ctx.args.seed,
                              ctx.folder, rename=lambda name: spec.rename(ctx.config, name))
    audible_random_codec(ctx)
    quantize_backbone(ctx.args, ctx.module)   # what the engine process does to the whole module
    module, embeddings = ctx.module, ctx.module.thinker.model.embed_tokens
    module.thinker = None
    module.thinker_embeddings = embeddings
    ctx.resources["speaking_module"] = module
    return module


def worker_talker(ctx) -> TalkerExecutor:
    """Node `talker` in a worker group (`LoaderSpec.worker_executors`)."""
    module = speaking_module(ctx)
    return talker_executor(ctx, module.talker, module.thinker_embeddings)


def worker_code2wav(ctx) -> Code2WavExecutor:
    """Node `code2wav` in a worker group (`LoaderSpec.worker_executors`)."""
    return Code2WavExecutor(speaking_module(ctx).code2wav)


@torch.no_grad()
def audible_random_codec(ctx) -> None:
    """Random weights of N(0, 0.02) shrink Code2Wav's signal ~5x a conv layer: a random model
    would only ever say zeros. Its convs get std 1/sqrt(fan-in) instead (a demo that is heard,
    and tests that compare samples that are not all zero)."""
    if not (ctx.random_weights and isinstance(ctx.module, Qwen3Omni)):
        return
    generator = torch.Generator().manual_seed(ctx.args.seed + 1)
    last = ctx.module.code2wav.decoder[-1].conv   # the output conv: a quiet signal, not a clipped one
    for module in ctx.module.code2wav.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            weight = module.weight
            fan_in = weight[0].numel() if isinstance(module, torch.nn.Conv1d) else weight.shape[0] * weight.shape[2]
            std = fan_in ** -0.5 * (0.02 if module is last else 1.0)
            values = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            weight.copy_(values.to(weight.dtype))


THINKER_LOADER = LoaderSpec(
    build=build,
    read_source=read_thinker_source,
    rename=checkpoint_name,
    after_weights=audible_random_codec,
    kv_layout=lambda config: decoder_kv_layout(config.text),
    resources=speech_resources,
    decode_step=thinker_of,
    serve=serve_thinker,
    worker_executors={TALKER.name: worker_talker, CODE2WAV.name: worker_code2wav},
)
