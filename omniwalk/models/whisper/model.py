"""Whisper as a walk graph: a stateless encoder node and a stateful decoder node.

    transcript stream (budgeted: max_output_tokens counts its tokens; stop: EOS)
      encode:   encoder(features) -> encoder_states                Keep     (the windows known up front)
      prefill:  decoder(DecoderPrompt) -> token, window   ToClient, Keep    (first item)
      decode:   Loop "decode" [ decoder(token) -> token, window   ToClient ]   (cap N - 1)

The plan: encode, then prefill from the kept encoder states and the request's forced
prompt, then decode from the kept token, then done. With N = 1 the stream ends at its
prefill. The encoder batches the windows of every request that reaches it in one step;
the decoder batches prefill chunks and decode steps of all streams (see executors.py for
its phases: language detection, windows, the window boundary inside the decode loop).

Audio longer than one window: the decoder runs the windows in order on the one stream,
each from the same forced prompt with its own encoder states (window w's transcript is
not a prompt for window w + 1, as transformers' default). Without timestamps the windows
follow each other every 30 s and the encoder node encodes them all up front; with
timestamps a window starts where the last one's timestamps say (timestamps.py), so the
encoder node encodes the first and the decoder node each later one as it starts. The
budget counts transcript tokens across all windows; the EOS that ends a window other
than the last is not emitted. The texts of the windows are joined with a single space
(transcribe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniwalk.engine.cross_attention import CrossAttentionCache
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.graph import (
    BudgetSpec, Keep, Loop, ModelGraph, Node, Sequential, StreamSpec, StreamView, ToClient, Walk, WalkCall,
)
from omniwalk.models.whisper.config import ForcedPrompt, WhisperGenerationConfig
from omniwalk.models.whisper.executors import DecoderExecutor, DecoderPrompt, EncoderExecutor
from omniwalk.models.whisper.features import LogMelFeatures, MelFrames
from omniwalk.models.whisper.modeling import WhisperForConditionalGeneration

TRANSCRIPT_STREAM = "transcript"

ENCODER = Node("encoder", inputs=("features",), outputs=("encoder_states",))
DECODER = Node("decoder", inputs=("tokens",), outputs=("token", "window"), stateful=True)


def whisper_nodes(config) -> tuple[Node, ...]:
    """The graph's nodes (`ModelFamily.nodes`)."""
    return ENCODER, DECODER


def whisper_graph() -> ModelGraph:
    emit = (ToClient("token", "tokens"), ToClient("window", "windows"))
    encode = Walk("encode", ("features",), Sequential(ENCODER, Keep("encoder_states")))
    prefill = Walk("prefill", ("tokens",), Sequential(DECODER, *emit, Keep("token")))
    decode = Walk("decode", ("tokens",), Loop("decode", Sequential(DECODER, *emit), carry={"token": "tokens"}))
    return ModelGraph([encode, prefill, decode], [StreamSpec(TRANSCRIPT_STREAM, BudgetSpec("token", loop="decode"))])


@dataclass(frozen=True)
class TranscriptionInputs:
    """The preprocessed request of a Whisper model."""

    audio: MelFrames              # the recording's mel frames, on the CPU
    prompt: ForcedPrompt          # the decoder prompt of every window
    temperatures: tuple[float, ...] = (0.0,)   # a window's attempts, in order (fallback.py)
    word_timestamps: bool = False              # each window's token times by alignment (alignment.py)

    @property
    def encoded_seeks(self) -> tuple[int, ...]:
        """The windows the encoder node encodes: those whose start is known before decoding."""
        return (0,) if self.prompt.timestamps else self.audio.consecutive_seeks

    @property
    def features(self) -> torch.Tensor:
        """[len(encoded_seeks), num_mel_bins, window_frames]"""
        return self.audio.windows(self.encoded_seeks)


def whisper_plan(view: StreamView) -> WalkCall | None:
    request: TranscriptionInputs = view.request
    if view.last_walk is None:
        return WalkCall("encode", {"features": request.features})
    if view.last_walk == "encode":
        states = dict(zip(request.encoded_seeks, view.kept["encoder_states"]))
        return WalkCall("prefill", {"tokens": DecoderPrompt(states, request.audio, request.prompt,
                                                            request.temperatures, request.word_timestamps)})
    if view.last_walk == "prefill":
        return WalkCall("decode", {"tokens": view.kept["token"]})
    return None


class WhisperTranscriptionModel:
    """Whisper served through the runtime (implements `ServedModel`)."""

    def __init__(self, net: WhisperForConditionalGeneration, cache: PagedKVCache, cross: CrossAttentionCache,
                 generation: WhisperGenerationConfig, features: LogMelFeatures, *, max_batch_size: int = 256,
                 max_encoder_windows: int = 16, decode_graphs: DecodeGraphs | None = None):
        self.net = net
        self.config = net.config
        self.cache = cache
        self.cross = cross
        self.generation = generation
        self.features = features
        self.graph = whisper_graph()
        self.executors = {
            ENCODER.name: EncoderExecutor(net.encoder, max_encoder_windows, max_batch_size),
            DECODER.name: DecoderExecutor(net, cache, cross, generation, max_batch_size, decode_graphs=decode_graphs),
        }

    @property
    def sampling_rate(self) -> int:
        return self.features.config.sampling_rate

    def plan(self, view: StreamView) -> WalkCall | None:
        return whisper_plan(view)
