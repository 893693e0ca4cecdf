"""Orpheus as a walk graph: a Llama backbone emits audio-code tokens on stream "codes";
a stream edge feeds them to SNAC on stream "audio", which sends PCM to the client.
The codes go to the client deferred: with the next audio chunk (or the final record).

    codes stream (budgeted: max_output_tokens counts these tokens; stop: end_of_speech)
      prefill:  backbone(prompt) -> token   ToClient("codes", deferred), ToStream("audio"), Keep
      decode:   Loop "decode" [ backbone(token) -> token  ToClient, ToStream ]   (cap N - 1)
                      |
                      |  StreamEdge(codes -> audio, SlidingWindow(window=28, stride=7))
                      v  a window of the last 4 frames (28 codes) at every 7th code from the 28th
    audio stream
      vocode:   snac_decoder(window, emit) -> pcm   ToClient("audio"), Keep("window")

The window slides over codes, not frames (a producer emits one token per step; grouping
into frames would take one more node on the decode loop). Windows are released at
counts 28, 35, 42, ..., always frame-aligned; the plan turns each into whole frames.

Which samples each vocode emits. F = complete frames (partial frames, N % 7 codes, are
dropped, never padded); S = samples per frame (2048 for snac_24khz); the windows decode
4 frames with their left/right context as the reference does, and emit:

    frames:              0    1    2    3    4    5    6          F = 7
    window at code 28:  [0    1    2    3]                       emits frames 0, 1
    window at code 35:       [1    2    3    4]                  emits frame 2  (its samples S:2S)
    window at code 42:            [2    3    4    5]             emits frame 3
    window at code 49:                 [3    4    5    6]        emits frame 4
    final flush:                       [3    4    5    6]        emits frames 5, 6 (2S:4S)

    F < 4: nothing is released before the end; the flush decodes frames [0, F) at once
    and emits all of them. F = 0: no audio at all.

So `samples_received(F) = F * S`: every complete frame exactly once. Each window's
centre (S:2S) is what the Orpheus reference decoder yields per window; it drops frame 0
and the last two frames, which we emit from the first and the last window. The final
flush re-decodes the last full window (kept by the walk: one extra SNAC window per
request) with the same noise, so its samples are those that window had, and N = 7F + r
codes give the same audio as 7F.
The stop id is never pushed to the audio stream (the runtime drops the item that
stopped a stream), so it never becomes audio.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omniwalk.engine.causal_lm_executor import CausalLMExecutor
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.host_to_device import to_device
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.engine.sampler import row_key, row_keys
from omniwalk.engine.sampling_graphs import CandidateTable
from omniwalk.graph import (
    BudgetSpec, Keep, Loop, ModelGraph, Node, Sequential, SlidingWindow, StreamEdge, StreamSpec, StreamView,
    ToClient, ToStream, Walk, WalkCall,
)
from omniwalk.models.orpheus.config import CODES_PER_FRAME, OrpheusTokens, samples_per_frame
from omniwalk.models.orpheus.snac import SeededNoise, SnacConfig, SnacDecoder
from omniwalk.models.orpheus.snac_graphs import SnacGraphs
from omniwalk.runtime.executor import NodeCall, NodeExecutor

CODES_STREAM = "codes"
AUDIO_STREAM = "audio"
WINDOW_FRAMES = 4            # frames per decoded window
CENTRE = (1, 2)              # the window frames the reference keeps (samples S:2S)
HEAD = (0, CENTRE[1])        # a request's first window emits its frames 0, 1
TAIL = (CENTRE[1], WINDOW_FRAMES)   # the final flush: the last window's frames 2, 3

BACKBONE = Node("backbone", inputs=("tokens",), outputs=("token",), stateful=True)
SNAC_DECODER = Node("snac_decoder", inputs=("window", "emit"), outputs=("pcm",))


def orpheus_nodes(config) -> tuple[Node, ...]:
    """The graph's nodes (`ModelFamily.nodes`)."""
    return BACKBONE, SNAC_DECODER


def orpheus_graph() -> ModelGraph:
    # counted, then pushed; the client gets the codes with the next audio chunk
    emit = (ToClient("token", "codes", deferred=True), ToStream("token", AUDIO_STREAM))
    prefill = Walk("prefill", ("tokens",), Sequential(BACKBONE, *emit, Keep("token")))
    decode = Walk("decode", ("tokens",), Loop("decode", Sequential(BACKBONE, *emit), carry={"token": "tokens"}))
    vocode = Walk("vocode", ("window", "emit"), Sequential(SNAC_DECODER, ToClient("pcm", "audio"), Keep("window")))
    window = WINDOW_FRAMES * CODES_PER_FRAME
    return ModelGraph(
        [prefill, decode, vocode],
        [StreamSpec(CODES_STREAM, BudgetSpec("token", loop="decode")), StreamSpec(AUDIO_STREAM)],
        [StreamEdge(CODES_STREAM, AUDIO_STREAM, SlidingWindow(window=window, stride=CODES_PER_FRAME))],
    )


def complete_frames(num_codes: int) -> int:
    """Frames the audio stream decodes from `num_codes` audio codes (a partial frame is dropped)."""
    return num_codes // CODES_PER_FRAME


def samples_received(num_complete_frames: int, frame_samples: int = 2048) -> int:
    """PCM samples a request receives in total: every complete frame once, S per frame."""
    return num_complete_frames * frame_samples


@dataclass(frozen=True)
class OrpheusPrompt:
    """The preprocessed request: the framed prompt ids (see config.OrpheusTokens.prompt_ids)."""

    token_ids: list[int]


@dataclass(frozen=True)
class Window:
    """Whole frames of SNAC codes: frames [first_frame, first_frame + num_frames) of a request."""

    first_frame: int
    codes: tuple[int, ...]      # 7 per frame, codebook indices in frame order

    @property
    def num_frames(self) -> int:
        return len(self.codes) // CODES_PER_FRAME

    @classmethod
    def from_tokens(cls, tokens: OrpheusTokens, token_ids: list[int], start: int) -> "Window":
        """Complete frames of audio-code ids that begin at stream index `start` (a frame start)."""
        if start % CODES_PER_FRAME:
            raise ValueError(f"a window must start on a frame, got code index {start}")
        usable = len(token_ids) - len(token_ids) % CODES_PER_FRAME
        codes = tokens.codes_of(token_ids[:usable])
        return cls(start // CODES_PER_FRAME, codes)


def plan_audio(tokens: OrpheusTokens, view: StreamView) -> WalkCall | None:
    """The audio stream's plan: which frames to decode for this chunk, and which to emit
    (window-relative frame range). See the module docstring for the picture."""
    chunk = view.chunk
    if chunk is None:            # input closed and the final chunk handled
        return None
    if not chunk.is_final:       # a full window, frames [e - 3, e] for the newest frame e
        window = Window.from_tokens(tokens, chunk.items, chunk.start)
        emit = HEAD if window.first_frame == 0 else CENTRE
        return WalkCall("vocode", {"window": window, "emit": emit})
    last = view.kept.get("window")
    if last is not None:         # flush: the last window's frames after its centre
        return WalkCall("vocode", {"window": last, "emit": TAIL})
    window = Window.from_tokens(tokens, chunk.items, chunk.start)   # fewer than 4 frames in all
    if window.num_frames == 0:
        return None
    return WalkCall("vocode", {"window": window, "emit": (0, window.num_frames)})


def orpheus_plan(tokens: OrpheusTokens, view: StreamView) -> WalkCall | None:
    """codes: prefill, then decode from the kept token, then done. audio: `plan_audio`."""
    if view.name == AUDIO_STREAM:
        return plan_audio(tokens, view)
    if view.last_walk is None:
        return WalkCall("prefill", {"tokens": view.request.token_ids})
    if view.last_walk == "prefill":
        return WalkCall("decode", {"tokens": view.kept["token"]})
    return None


class AudioCodeMask:
    """Only audio codes of the next frame position may be sampled, plus end_of_speech
    unless the request ignores EOS. So every budgeted item is an audio code (or the stop),
    and position = number sampled so far mod 7."""

    def __init__(self, tokens: OrpheusTokens):
        self.tokens = tokens
        self._tables: dict[torch.device, CandidateTable] = {}

    def candidate_table(self, device: torch.device) -> CandidateTable:
        """Row `position + 7 * may_stop`: end_of_speech, then the codebook of that frame
        position (ascending ids), and which of them may be sampled; made once per device."""
        device = torch.device(device)
        found = self._tables.get(device)
        if found is None:
            size = self.tokens.codebook_size
            position = torch.arange(CODES_PER_FRAME).repeat(2)
            codes = self.tokens.audio_start + position.unsqueeze(1) * size + torch.arange(size)
            ids = torch.cat([torch.full((2 * CODES_PER_FRAME, 1), self.tokens.end_of_speech), codes], dim=1)
            allowed = torch.ones(ids.shape, dtype=torch.bool)
            allowed[:CODES_PER_FRAME, 0] = False
            found = self._tables[device] = CandidateTable(ids.to(device), allowed.to(device))
        return found

    def candidate_rows(self, calls: list[NodeCall], counts: list[int]) -> list[int]:
        """Each row's row of `candidate_table` (`counts`: ids each row sampled so far): its
        next frame position, + 7 if it may stop."""
        return [count % CODES_PER_FRAME + (0 if call.stream.params.stop.ignore_eos else CODES_PER_FRAME)
                for call, count in zip(calls, counts)]

    def __call__(self, logits: torch.Tensor, calls: list[NodeCall], output_ids: list[list[int]]) -> None:
        device, size = logits.device, self.tokens.codebook_size
        position = to_device([len(ids) % CODES_PER_FRAME for ids in output_ids], device=device)
        start = (self.tokens.audio_start + position * size).unsqueeze(1)          # [rows, 1]
        vocab = torch.arange(logits.shape[1], device=device).unsqueeze(0)          # [1, vocab]
        allowed = (vocab >= start) & (vocab < start + size)
        may_stop = to_device([not call.stream.params.stop.ignore_eos for call in calls], device=device)
        allowed |= (vocab == self.tokens.end_of_speech) & may_stop.unsqueeze(1)
        logits.masked_fill_(~allowed, float("-inf"))


NOISE_SALT = 0x534E4143   # keeps the noise keys apart from the sampler's


def noise_key(seed: int, first_frame: int) -> int:
    """Key of SNAC's noise for the window starting at `first_frame` of a request: a window
    decoded twice (the final flush) gets the same noise, hence the same samples."""
    return row_key(seed ^ NOISE_SALT, first_frame)


def noise_keys(seeds: list[int], first_frames: list[int]) -> np.ndarray:
    """`noise_key` of each (seed, first frame) pair, uint64."""
    return row_keys([seed ^ NOISE_SALT for seed in seeds], np.asarray(first_frames, dtype=np.uint64))


class HostPCM:
    """The int16 samples of one SNAC forward, on their way to pinned host memory."""

    def __init__(self, samples: torch.Tensor | None, copied: "torch.cuda.Event | None"):
        self.samples = samples      # [rows, samples]
        self.copied = copied        # recorded after the copy (None: already on the host)
        self._array: np.ndarray | None = None

    def rows(self) -> np.ndarray:
        if self._array is None:   # once per forward, not once per row
            if self.copied is not None:
                self.copied.synchronize()   # releases the GIL while it waits
                self.copied = None
            self._array = self.samples.numpy()
        return self._array

    def __reduce__(self):
        # Out of an engine process (omniwalk.ipc): waits for the copy there, on its output
        # thread; the forward's samples then cross once, one out-of-band buffer straight from
        # pinned memory, and its rows' PendingPCMs refer to it (pickle's memo).
        return _host_pcm, (self.rows(),)


def _host_pcm(rows: np.ndarray) -> HostPCM:
    """A `HostPCM` that crossed from the engine process: its samples already on the host."""
    host = HostPCM(None, None)
    host._array = rows
    return host


@dataclass(frozen=True)
class PendingPCM:
    """The `pcm` of one vocode call: samples [start, end) of one row of a `HostPCM`.

    The codec's output reaches the host behind an event instead of a synchronizing copy,
    so the engine loop goes on to the next step while the GPU decodes; whoever hands the
    audio to a client (`SpeechOutputProcessor`, on the engine's output thread) waits in
    `tobytes()`, in the order the chunks were produced."""

    host: HostPCM
    row: int
    start: int
    end: int

    def samples(self) -> np.ndarray:
        """int16 samples (waits for the copy)."""
        return self.host.rows()[self.row, self.start:self.end]

    def tobytes(self) -> bytes:
        """int16 little-endian mono samples."""
        return self.samples().astype("<i2", copy=False).tobytes()

    def __reduce__(self):
        return PendingPCM, (self.host, self.row, self.start, self.end)


class SnacDecoderExecutor(NodeExecutor):
    """Node `snac_decoder`: (window, emit) -> pcm, a `PendingPCM` (int16 samples).

    Stateless. One SNAC forward per (window length, emitted frames) in the batch, decoding
    only the emitted samples; converted as the reference does (x * 32767, truncated toward
    zero)."""

    def __init__(self, decoder: SnacDecoder, max_batch_size: int = 256,
                 graphs: dict[tuple[int, int], SnacGraphs] | None = None):
        self.decoder = decoder
        # full windows through CUDA graphs (see snac_graphs.py), one set per emitted frame
        # range (HEAD, CENTRE, TAIL), each decoding just those samples
        self.graphs = graphs or {}
        self.frame_samples = samples_per_frame(decoder.config)
        self.max_batch_size = max_batch_size
        self.device = next(decoder.parameters()).device
        # Its own CUDA stream: the codec's kernels run beside the backbone's look-ahead step
        # (queued on the default stream), and the PCM copy's event waits for them alone.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict[str, Any]]:
        if self.stream is None:
            return self._decode(calls)
        with torch.cuda.stream(self.stream):
            return self._decode(calls)

    def _decode(self, calls: list[NodeCall]) -> list[dict[str, Any]]:
        groups: dict[tuple[int, tuple[int, int]], list[int]] = defaultdict(list)   # (frames, emit) -> calls
        for index, call in enumerate(calls):
            groups[call.inputs["window"].num_frames, call.inputs["emit"]].append(index)
        results: list[dict[str, Any]] = [{} for _ in calls]
        for (frames, emit), rows in groups.items():
            windows = [calls[i].inputs["window"] for i in rows]
            keys = noise_keys([calls[i].stream.params.seed for i in rows], [w.first_frame for w in windows])
            # only the emitted samples are decoded (SnacDecoder's keep: the least input that
            # determines them); a centre is ~half the work of its whole window
            keep = (emit[0] * self.frame_samples, emit[1] * self.frame_samples)
            graphs = self.graphs.get(emit) if frames == WINDOW_FRAMES else None
            if graphs is not None:
                audio = graphs.run(np.array([w.codes for w in windows]), keys)        # [rows, samples]
            else:
                noise = SeededNoise(keys) if self.decoder.config.noise else None
                whole = emit == (0, frames)   # a short request's only window: nothing to crop
                audio = self.decoder(self._levels(windows), noise, None if whole else keep)[:, 0]
            pcm = self._to_host((audio * 32767).to(torch.int16))                  # one copy per group
            for row, index in enumerate(rows):
                results[index] = {"pcm": PendingPCM(pcm, row, 0, keep[1] - keep[0])}
        return results

    def _to_host(self, pcm: torch.Tensor) -> "HostPCM":
        """Start the copy of `pcm` to pinned host memory; the engine loop never waits for it."""
        if self.stream is None:
            return HostPCM(pcm, None)
        host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
        host.copy_(pcm, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.stream)
        return HostPCM(host, copied)

    def _levels(self, windows: list[Window]) -> list[torch.Tensor]:
        # [rows, frames, 7] -> level 0: c0 | level 1: c1 c4 | level 2: c2 c3 c5 c6, frame-major
        codes = to_device(np.array([w.codes for w in windows]), torch.long, self.device)
        frames = codes.view(len(windows), -1, CODES_PER_FRAME)
        return [frames[:, :, 0], frames[:, :, [1, 4]].flatten(1), frames[:, :, [2, 3, 5, 6]].flatten(1)]


class OrpheusModel:
    """Orpheus served through the runtime (implements `ServedModel`)."""

    def __init__(self, lm: torch.nn.Module, cache: PagedKVCache, snac: SnacDecoder | None, tokens: OrpheusTokens,
                 *, max_batch_size: int = 256, decode_graphs: DecodeGraphs | None = None,
                 snac_graphs: dict[tuple[int, int], SnacGraphs] | None = None,
                 prefill_graphs: PrefillGraphs | None = None, codec: SnacConfig | None = None):
        self.lm = lm
        self.cache = cache
        self.snac = snac        # None: node snac_decoder runs in a worker process (a placement), its executor set there
        self.tokens = tokens
        codec = snac.config if snac is not None else codec
        self.frame_samples = samples_per_frame(codec)
        self.sampling_rate = codec.sampling_rate
        self.graph = orpheus_graph()
        self.executors = {
            BACKBONE.name: CausalLMExecutor(lm, cache, max_batch_size, decode_graphs, AudioCodeMask(tokens),
                                            prefill_graphs=prefill_graphs),
        }
        if snac is not None:
            self.executors[SNAC_DECODER.name] = SnacDecoderExecutor(snac, max_batch_size, snac_graphs)

    def plan(self, view: StreamView) -> WalkCall | None:
        return orpheus_plan(self.tokens, view)
