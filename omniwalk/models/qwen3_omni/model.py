"""Qwen3-Omni's Thinker as a walk graph: two media encoder nodes and the language model.

    text stream (budgeted: max_tokens counts its tokens; stop: EOS, stop ids)
      encode_audio:   audio_encoder(features) -> audio_embeds        Keep
      encode_images:  vision_encoder(images)  -> image_embeds        Keep
      prefill:        thinker(ThinkerPrompt)  -> token   ToClient, Keep     (first item)
      decode:         Loop "decode" [ thinker(token) -> token   ToClient ]  (cap N - 1)

The plan: the encoders a request needs (audio, then images), then prefill from the kept
embeddings placed into the prompt, then decode, then done. With N = 1 the stream ends at
its prefill. A text-only request goes straight to prefill. Each encoder batches the items
of every request that reaches it in a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.graph import (
    BudgetSpec, Keep, Loop, ModelGraph, Node, Sequential, StreamSpec, StreamView, ToClient, Walk, WalkCall,
)
from omniwalk.models.qwen3_omni.executors import (
    AudioEncoderExecutor, ImagePatches, MediaSpan, ThinkerExecutor, ThinkerPrompt, VisionEncoderExecutor,
)
from omniwalk.models.qwen3_omni.positions import PromptPositions
from omniwalk.models.qwen3_omni.thinker import Thinker

TEXT_STREAM = "text"

AUDIO_ENCODER = Node("audio_encoder", inputs=("features",), outputs=("audio_embeds",))
VISION_ENCODER = Node("vision_encoder", inputs=("images",), outputs=("image_embeds",))
THINKER = Node("thinker", inputs=("tokens",), outputs=("token", "logprobs"), stateful=True)


def thinker_graph() -> ModelGraph:
    emit = (ToClient("token", "tokens"), ToClient("logprobs", "logprobs"))
    walks = [
        Walk("encode_audio", ("features",), Sequential(AUDIO_ENCODER, Keep("audio_embeds"))),
        Walk("encode_images", ("images",), Sequential(VISION_ENCODER, Keep("image_embeds"))),
        Walk("prefill", ("tokens",), Sequential(THINKER, *emit, Keep("token"))),
        Walk("decode", ("tokens",), Loop("decode", Sequential(THINKER, *emit), carry={"token": "tokens"})),
    ]
    return ModelGraph(walks, [StreamSpec(TEXT_STREAM, BudgetSpec("token", loop="decode"))])


@dataclass(frozen=True)
class ThinkerRequest:
    """The preprocessed request (omniwalk.models.qwen3_omni.frontend): the prompt with each
    media item's placeholders expanded, and the items ready for their encoders."""

    token_ids: list[int]
    positions: PromptPositions
    spans: tuple[MediaSpan, ...] = ()
    audio_features: tuple[torch.Tensor, ...] = ()    # [mels, frames] float32 per clip, prompt order
    images: tuple[ImagePatches, ...] = ()
    cache_keys: list[int] | None = None


def thinker_plan(view: StreamView) -> WalkCall | None:
    request: ThinkerRequest = view.request
    last = view.last_walk
    if last is None and request.audio_features:
        return WalkCall("encode_audio", {"features": list(request.audio_features)})
    if last in (None, "encode_audio") and request.images:
        return WalkCall("encode_images", {"images": list(request.images)})
    if last in (None, "encode_audio", "encode_images"):
        return WalkCall("prefill", {"tokens": ThinkerPrompt(
            request.token_ids, request.positions, request.spans, request.cache_keys,
            view.kept.get("audio_embeds", []), view.kept.get("image_embeds", []))})
    if last == "prefill":
        return WalkCall("decode", {"tokens": view.kept["token"]})
    return None


class ThinkerModel:
    """The Thinker served through the runtime (implements `ServedModel`)."""

    def __init__(self, thinker: Thinker, cache: PagedKVCache, *, max_batch_size: int = 256,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None):
        self.thinker = thinker
        self.cache = cache
        self.graph = thinker_graph()
        self.executors = {
            AUDIO_ENCODER.name: AudioEncoderExecutor(thinker.audio_tower, max_batch_size),
            VISION_ENCODER.name: VisionEncoderExecutor(thinker.visual, thinker.config.vision.spatial_merge_size,
                                                       max_batch_size),
            THINKER.name: ThinkerExecutor(thinker, cache, max_batch_size, decode_graphs,
                                           prefill_graphs=prefill_graphs),
        }

    def plan(self, view: StreamView) -> WalkCall | None:
        return thinker_plan(view)
