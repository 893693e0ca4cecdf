"""Whisper as a walk graph: a stateless encoder node and a stateful decoder node.

    transcript stream (budgeted: max_output_tokens counts its tokens; stop: EOS)
      encode:   encoder(features) -> encoder_states                          Keep   (one window)
      prefill:  decoder(DecoderPrompt) -> token, window, window_end   Keep, EndWalkIf,
                                                                      ToClient, Keep (first item)
      decode:   Loop "decode" [ decoder(token) -> token, window, window_end   Keep, EndWalkIf,
                                                                              ToClient ]
      end:      token, window (the last window's EOS)                        ToClient

Each window of the audio is its own walks, chosen by the plan: encode the window (the
encoder batches the windows of every stream that reaches it in one step), prefill from
the forced prompt with its encoder states, decode. When a window ends (its EOS sampled,
or its decoder context full) the decoder writes a `WindowEnd` instead of an item and the
walk ends there (`EndWalkIf`): the window's EOS is not emitted, since the runtime's stop
would end the stream at it. The plan reads the kept `WindowEnd`:

    the window failed the fallback's checks    prefill it again at the next temperature
                                               (fallback.py; its encoder states are kept)
    the next window starts inside the audio    encode the window at `next_seek`
    else                                       `end`: emit the EOS; then the stream is done

    window 0: encode  prefill  decode ... (EOS: WindowEnd)
    window 1: encode  prefill  decode ... (EOS: WindowEnd)   end (EOS emitted: stop)
    client:   t0 t1 t2 u0 u1 EOS        -- the budget counts these items

Without timestamps the next window starts 30 s later; with them, where the window's
timestamps say (timestamps.py). Every window starts from the same forced prompt (window
w's transcript is not a prompt for window w + 1, as transformers' default). Language
detection is a phase of window 0's prefill (executors.py). The budget is the stream's:
the runtime counts and stop-checks every item the stream emits, in whichever walk, so
N tokens span the windows (the decode loop's cap, N - 1, bounds each window's loop; the
stop at the N-th item ends it). With N = 1 the stream ends at its first prefill. The
texts of the windows are joined with a single space (transcribe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniwalk.engine.cross_attention import CrossAttentionCache
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.graph import (
    BudgetSpec, EndWalkIf, Keep, Loop, ModelGraph, Node, Sequential, StreamSpec, StreamView, ToClient, Walk,
    WalkCall,
)
from omniwalk.models.whisper.config import ForcedPrompt, WhisperGenerationConfig
from omniwalk.models.whisper.encoder_graphs import EncoderGraphs
from omniwalk.models.whisper.executors import DecoderExecutor, DecoderPrompt, EncoderExecutor, WindowEnd
from omniwalk.models.whisper.features import LogMelFeatures, MelFrames
from omniwalk.models.whisper.modeling import WhisperForConditionalGeneration

TRANSCRIPT_STREAM = "transcript"

ENCODER = Node("encoder", inputs=("features",), outputs=("encoder_states",))
DECODER = Node("decoder", inputs=("tokens",), outputs=("token", "window", "window_end"), stateful=True)


def whisper_nodes(config) -> tuple[Node, ...]:
    """The graph's nodes (`ModelFamily.nodes`)."""
    return ENCODER, DECODER


def whisper_graph() -> ModelGraph:
    emit = (ToClient("token", "tokens"), ToClient("window", "windows"))
    ends = (Keep("window_end"), EndWalkIf("window_end"))   # a window's EOS: no item; the plan decides
    encode = Walk("encode", ("features",), Sequential(ENCODER, Keep("encoder_states")))
    prefill = Walk("prefill", ("tokens",), Sequential(DECODER, *ends, *emit, Keep("token")))
    decode = Walk("decode", ("tokens",), Loop("decode", Sequential(DECODER, *ends, *emit), carry={"token": "tokens"}))
    end = Walk("end", ("token", "window"), Sequential(*emit))
    return ModelGraph([encode, prefill, decode, end],
                      [StreamSpec(TRANSCRIPT_STREAM, BudgetSpec("token", loop="decode"))])


@dataclass(frozen=True)
class TranscriptionInputs:
    """The preprocessed request of a Whisper model."""

    audio: MelFrames              # the recording's mel frames, on the CPU
    prompt: ForcedPrompt          # the decoder prompt of every window
    temperatures: tuple[float, ...] = (0.0,)   # a window's attempts, in order (fallback.py)
    word_timestamps: bool = False              # each window's token times by alignment (alignment.py)

    def decoder_prompt(self, encoder_states: torch.Tensor, seek: int, attempt: int) -> DecoderPrompt:
        return DecoderPrompt(encoder_states, seek, attempt, self.audio, self.prompt, self.temperatures,
                             self.word_timestamps)


def whisper_plan(view: StreamView) -> WalkCall | None:
    """encode, prefill, decode per window (and again per attempt); see the module docstring."""
    request: TranscriptionInputs = view.request
    last, ended = view.last_walk, view.kept.get("window_end")
    if last is None:
        return _encode(request, 0)
    if last == "end":
        return None
    if last == "encode":   # `ended`: the window before this one, if any
        seek = 0 if ended is None else ended.next_seek
        return WalkCall("prefill", {"tokens": request.decoder_prompt(view.kept["encoder_states"][0], seek, 0)})
    if ended is None:      # the window goes on after its prefill (a stop or the cap ends a decode walk unasked)
        return WalkCall("decode", {"tokens": view.kept["token"]}) if last == "prefill" else None
    return _after_window(request, ended, view.kept["encoder_states"][0])


def _after_window(request: TranscriptionInputs, ended: WindowEnd, encoder_states: torch.Tensor) -> WalkCall:
    if ended.fails:
        return WalkCall("prefill", {"tokens": request.decoder_prompt(encoder_states, ended.info.seek,
                                                                     ended.info.attempt + 1)})
    if ended.next_seek < request.audio.num_frames:
        return _encode(request, ended.next_seek)
    return WalkCall("end", {"token": ended.eos, "window": ended.info})


def _encode(request: TranscriptionInputs, seek: int) -> WalkCall:
    return WalkCall("encode", {"features": request.audio.windows((seek,))})


class WhisperTranscriptionModel:
    """Whisper served through the runtime (implements `ServedModel`)."""

    def __init__(self, net: WhisperForConditionalGeneration, cache: PagedKVCache, cross: CrossAttentionCache,
                 generation: WhisperGenerationConfig, features: LogMelFeatures, *, max_batch_size: int = 256,
                 max_encoder_windows: int = 16, decode_graphs: DecodeGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None, encoder_graphs: EncoderGraphs | None = None):
        self.net = net
        self.config = net.config
        self.cache = cache
        self.cross = cross
        self.generation = generation
        self.features = features
        self.graph = whisper_graph()
        self.executors = {
            ENCODER.name: EncoderExecutor(net.encoder, max_encoder_windows, max_batch_size, encoder_graphs),
            DECODER.name: DecoderExecutor(net, cache, cross, generation, max_batch_size, decode_graphs=decode_graphs,
                                          prefill_graphs=prefill_graphs),
        }

    @property
    def sampling_rate(self) -> int:
        return self.features.config.sampling_rate

    def plan(self, view: StreamView) -> WalkCall | None:
        return whisper_plan(view)
