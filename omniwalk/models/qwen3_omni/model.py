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

A checkpoint with a Talker speaks (`thinker_graph(speaks=True)`): the text stream also
pushes its tokens to the talker stream, and two more streams follow it:

    text stream      ... as above, each token also ToStream("talker")
                      |
                      |  StreamEdge(text -> talker, FixedChunks(1): each token as it comes)
                      v
    talker stream (budgeted: the frame budget counts frames; stop: codec EOS)
      talker_prefill: talker(TalkerPrompt)  -> frame   ToClient (deferred), ToStream("audio"), Keep
      talker_step:    talker(TextMore)      -> frame   (the same edges; one step per new token)
      talker_decode:  Loop "talker_decode" [ talker(TextEnd | frame) -> frame ]   (cap T - 1)
                      |
                      |  StreamEdge(talker -> audio, LeftContext: a small first chunk, then larger)
                      v
    audio stream
      code2wav:       code2wav(frames) -> pcm   ToClient("audio")

A frame is one code per codebook (the Talker's first, the code predictor's residuals, in
one Talker step). The Talker follows the answer as it is written: its prefill once the
answer's first token exists, a step for each later token (step k reads token k + 1), and
when the text ends the decode loop, whose steps read <tts_eos> once and then <tts_pad>, until
codec EOS or the frame budget. So audio starts while the Thinker still writes, and the
frames are those of transformers' generate, which speaks the finished answer. A request
that asks for no audio ends its talker stream when the text ends, and its audio stream
with it.

Media in the prompt's user turns: the Talker's prompt reads the Thinker's hidden states
there. The request carries a `MediaHidden` (`talker_media`, made by the frontend), which
the Thinker's prefill fills (`ThinkerExecutor`); the talker prefill's `TalkerStart` takes
its rows, and the Talker's (t, h, w) positions when the user turns hold images.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.graph import (
    BudgetSpec, FixedChunks, Keep, LeftContext, Loop, ModelGraph, Node, Sequential, StreamEdge, StreamSpec,
    StreamView, ToClient, ToStream, Walk, WalkCall,
)
from omniwalk.models.qwen3_omni.executors import (
    AudioEncoderExecutor, ImagePatches, MediaHidden, MediaSpan, ThinkerExecutor, ThinkerPrompt, VisionEncoderExecutor,
)
from omniwalk.models.qwen3_omni.positions import PromptPositions
from omniwalk.models.qwen3_omni.code2wav import exact_left_context
from omniwalk.models.qwen3_omni.code2wav_config import Code2WavConfig
from omniwalk.models.qwen3_omni.config import SpeechConfig
from omniwalk.models.qwen3_omni.speech_executors import TalkerStart, TextEnd, TextMore
from omniwalk.models.qwen3_omni.talker_config import TalkerConfig
from omniwalk.models.qwen3_omni.talker_prompt import (
    media_positions, talker_positions, talker_prompt, user_turn_positions,
)
from omniwalk.models.qwen3_omni.thinker import Thinker
from omniwalk.runtime.executor import NodeExecutor

TEXT_STREAM = "text"
TALKER_STREAM = "talker"
AUDIO_STREAM = "audio"

AUDIO_ENCODER = Node("audio_encoder", inputs=("features",), outputs=("audio_embeds",))
VISION_ENCODER = Node("vision_encoder", inputs=("images",), outputs=("image_embeds",))
THINKER = Node("thinker", inputs=("tokens",), outputs=("token", "logprobs"), stateful=True)
TALKER = Node("talker", inputs=("codes",), outputs=("frame",), stateful=True)
CODE2WAV = Node("code2wav", inputs=("frames",), outputs=("pcm",))

#: the talker stream's chunk policy: every token of the answer as it comes
EACH_TOKEN = FixedChunks(1)


def thinker_nodes(config) -> tuple[Node, ...]:
    """The graph's nodes (`ModelFamily.nodes`): the Talker's and Code2Wav's where the config speaks."""
    nodes = (AUDIO_ENCODER, VISION_ENCODER, THINKER)
    return nodes + (TALKER, CODE2WAV) if config.speech is not None else nodes


def thinker_graph(speaks: bool = False, code2wav_chunks: LeftContext | None = None) -> ModelGraph:
    """The Thinker's walks; with `speaks`, the Talker's and Code2Wav's too (`code2wav_chunks`:
    how the audio stream takes frames)."""
    emit = (ToClient("token", "tokens"), ToClient("logprobs", "logprobs"))
    if speaks:
        emit += (ToStream("token", TALKER_STREAM),)
    walks = [
        Walk("encode_audio", ("features",), Sequential(AUDIO_ENCODER, Keep("audio_embeds"))),
        Walk("encode_images", ("images",), Sequential(VISION_ENCODER, Keep("image_embeds"))),
        Walk("prefill", ("tokens",), Sequential(THINKER, *emit, Keep("token"))),
        Walk("decode", ("tokens",), Loop("decode", Sequential(THINKER, *emit), carry={"token": "tokens"})),
    ]
    streams = [StreamSpec(TEXT_STREAM, BudgetSpec("token", loop="decode"))]
    if not speaks:
        return ModelGraph(walks, streams)
    if code2wav_chunks is None:
        raise ValueError("a graph that speaks needs the audio stream's chunk policy")
    frame_emit = (ToClient("frame", "frames", deferred=True), ToStream("frame", AUDIO_STREAM))
    walks += [
        Walk("talker_prefill", ("codes",), Sequential(TALKER, *frame_emit, Keep("frame"))),
        Walk("talker_step", ("codes",), Sequential(TALKER, *frame_emit, Keep("frame"))),
        Walk("talker_decode", ("codes",), Loop("talker_decode", Sequential(TALKER, *frame_emit),
                                              carry={"frame": "codes"})),
        Walk("code2wav", ("frames",), Sequential(CODE2WAV, ToClient("pcm", "audio"))),
    ]
    streams += [StreamSpec(TALKER_STREAM, BudgetSpec("frame", loop="talker_decode")), StreamSpec(AUDIO_STREAM)]
    edges = [StreamEdge(TEXT_STREAM, TALKER_STREAM, EACH_TOKEN),
             StreamEdge(TALKER_STREAM, AUDIO_STREAM, code2wav_chunks)]
    return ModelGraph(walks, streams, edges)


@dataclass(frozen=True)
class ThinkerRequest:
    """The preprocessed request (omniwalk.models.qwen3_omni.frontend): the prompt with each
    media item's placeholders expanded, and the items ready for their encoders. `speaker`:
    the codec id of the voice to speak the answer in, None for text only. `media_hidden`:
    for a spoken answer to a prompt with media in its user turns, where the Thinker's
    prefill keeps its hidden states at those rows for the Talker (`talker_media`)."""

    token_ids: list[int]
    positions: PromptPositions
    spans: tuple[MediaSpan, ...] = ()
    audio_features: tuple[torch.Tensor, ...] = ()    # [mels, frames] float32 per clip, prompt order
    images: tuple[ImagePatches, ...] = ()
    cache_keys: list[int] | None = None
    speaker: int | None = None
    media_hidden: MediaHidden | None = None


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
            view.kept.get("audio_embeds", []), view.kept.get("image_embeds", []), request.media_hidden)})
    if last == "prefill":
        return WalkCall("decode", {"tokens": view.kept["token"]})
    return None


def talker_plan(view: StreamView, config: TalkerConfig) -> WalkCall | None:
    """The talker stream (see the module docstring): the prefill at the answer's first token,
    a step for each later one, the decode loop once the text ended. Nothing when the request
    asks for no audio, or the answer is empty (it was only its stop token)."""
    request: ThinkerRequest = view.request
    chunk = view.chunk
    if request.speaker is None:
        return None
    if view.last_walk is None:
        if chunk is None or not chunk.items:   # the text ended before it said anything
            return None
        prompt = talker_prompt(request.token_ids, chunk.items, request.speaker, config)
        if not prompt.media_rows:
            return WalkCall("talker_prefill", {"codes": TalkerStart(prompt, text_ended=chunk.is_final)})
        hidden = request.media_hidden
        if hidden is None or hidden.positions != prompt.media_positions or not hidden.complete:
            raise ValueError("the Thinker's prefill kept no hidden states for the media the Talker reads")
        return WalkCall("talker_prefill", {"codes": TalkerStart(
            prompt, text_ended=chunk.is_final, media_hidden=hidden.states,
            positions=talker_positions(config, prompt, user_image_grids(request, config)))})
    if view.last_walk == "talker_decode":
        return None
    if chunk is not None and chunk.num_new:
        return WalkCall("talker_step", {"codes": TextMore(tuple(chunk.items), ended=chunk.is_final)})
    return WalkCall("talker_decode", {"codes": TextEnd()})


def user_image_grids(request: ThinkerRequest, config: TalkerConfig) -> list[tuple[int, int, int]]:
    """The merged (t, h, w) grids of the images in the prompt's user turns, in order: what
    the Talker's rotary positions read (the rows it takes from the prompt are its user turns')."""
    user = set(user_turn_positions(request.token_ids, config.prompt))
    merge = config.media.spatial_merge_size
    grids = []
    for span in request.spans:
        if span.kind == "image" and span.start in user:
            t, h, w = request.images[span.index].grid
            grids.append((t, h // merge, w // merge))
    return grids


def talker_media(request: ThinkerRequest, config: TalkerConfig) -> MediaHidden | None:
    """What a request that speaks keeps of the Thinker's prefill for the Talker: its hidden
    states at the media rows of its user turns (None: there are none)."""
    positions = media_positions(request.token_ids, config)
    return MediaHidden(positions) if positions else None


def audio_plan(view: StreamView) -> WalkCall | None:
    """The audio stream: Code2Wav for every chunk with new frames."""
    chunk = view.chunk
    if chunk is None or chunk.num_new == 0:   # input closed; a final chunk with nothing new
        return None
    return WalkCall("code2wav", {"frames": chunk})


#: Code2Wav's chunks, in frames (12.5 a second): a small first one for the time to first
#: audio, then growing (4, 4, 8, 16, 32, 32, ...: each no longer than the audio already out, so
#: a client playing from the first chunk does not stall) up to the largest (each chunk
#: re-reads `exact_left_context` frames before it). Fixed 4-then-16 chunks stalled every
#: stream at c = 32 on the H200 by ~220 ms: 16 frames took longer to make than 4 to play.
#: The largest is 32, not 16: a batch-32 chunk of 32 frames took 109 ms on the H200, two of
#: 16 frames 145 ms (the left context and the launches are paid per chunk).
CODE2WAV_FIRST_FRAMES = 4
CODE2WAV_CHUNK_FRAMES = 32


@dataclass(frozen=True)
class SpeechParts:
    """What a model that speaks adds to the Thinker: the Talker's and Code2Wav's configs (the
    plan and the audio stream's chunks read them), and the executors of those of the two nodes
    that run in this process. A placement may run them in a worker group
    (`LoaderSpec.worker_executors`): their proxies are added later (`NodeWorkers.attach`)."""

    config: SpeechConfig
    executors: Mapping[str, NodeExecutor]


def code2wav_chunks(config: Code2WavConfig) -> LeftContext:
    return LeftContext(CODE2WAV_CHUNK_FRAMES, exact_left_context(config), first_size=CODE2WAV_FIRST_FRAMES,
                       grow=True)


class ThinkerModel:
    """The Thinker served through the runtime (implements `ServedModel`); with `speech`, the
    Talker and Code2Wav as well."""

    def __init__(self, thinker: Thinker, cache: PagedKVCache, *, max_batch_size: int = 256,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None,
                 speech: SpeechParts | None = None):
        self.thinker = thinker
        self.cache = cache
        self.speech = speech
        self.max_batch_size = max_batch_size
        self.executors = {
            AUDIO_ENCODER.name: AudioEncoderExecutor(thinker.audio_tower, max_batch_size),
            VISION_ENCODER.name: VisionEncoderExecutor(thinker.visual, thinker.config.vision.spatial_merge_size,
                                                       max_batch_size),
            THINKER.name: ThinkerExecutor(thinker, cache, max_batch_size, decode_graphs,
                                           prefill_graphs=prefill_graphs,
                                           hidden_layer=None if speech is None else
                                           speech.config.talker.accept_hidden_layer),
        }
        if speech is None:
            self.graph = thinker_graph()
            return
        self.graph = thinker_graph(speaks=True, code2wav_chunks=code2wav_chunks(speech.config.code2wav))
        self.executors.update(speech.executors)

    def plan(self, view: StreamView) -> WalkCall | None:
        if view.name == TALKER_STREAM:
            return talker_plan(view, self.speech.config.talker)
        if view.name == AUDIO_STREAM:
            return audio_plan(view)
        return thinker_plan(view)
