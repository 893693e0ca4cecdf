"""The two nodes of Whisper: a stateless encoder and the stateful decoder.

Encoder: a batch stacks the windows of all its calls ([sum W, mels, 3000]; Whisper's
plan sends one window a call) and runs them `max_windows` at a time; each call gets its
own [W, 1500, d] states back.

Decoder: the shared `CausalLMExecutor` (chunked prefill beside decode steps, the decode
CUDA graphs, the look-ahead step, sampling and its graphs), plus per stream the current
window's encoder states and a cross-attention slot, bound into every forward pass the
way a hybrid model binds its state slots (`_eager_inputs`, `_row_slots`). The sequence
is the token sequence of the window being decoded (paged self-attention KV); the stream's
state (`TranscriptState`) lives across its windows' walks. What a call does when its
last position is computed depends on the stream's phase:

    phase            sequence (token_ids)                  at the last position
    detect language  [sot]                                 argmax over language ids; the
                                                           sequence becomes window 0's prompt
    window w         prompt, then fed-back samples         sample; emit it, unless it is
                                                           EOS: then the window ends

    window 0: [prev.. sot en transcribe notimestamps] t0 t1 t2 EOS    (WindowEnd, no item)
    window 1: [prev.. sot en transcribe notimestamps] u0 u1 EOS       (WindowEnd; the plan's
    client:   t0 t1 t2 u0 u1 EOS                                       `end` walk emits EOS)

A window's end is not an item (the runtime's stop would end the whole stream at its
EOS): the call's `window_end` is a `WindowEnd` (its EOS, the fallback's verdict, where
the next window would start: 30 s later without timestamps, where its timestamps say with
them, timestamps.py), and the walk ends there (`EndWalkIf`); the plan (model.py) picks
the next walk. A later window, or a window again at the next temperature (fallback.py),
comes back as a prefill (`begin` with a `DecoderPrompt`, `TranscriptState.start_window`):
its encoder states from the encoder node, and `_sampling_params` gives the row that
attempt's temperature.

Language detection and a new window restart the stream's sequence from position 0
(`restart`): the old sequence's pages are given back and the new one's taken through
the runtime's check/act (`can_reserve`, then `reserve`), never inside `run`. Detection
ends its call without outputs (None): the runtime keeps the stream at the node and the
next step computes window 0's prompt (chunked like any prefill). Language detection is
not a sample (no sample index, whatever the temperature): those calls take their own
eager pass beside the shared step.

A window's decoder context holds `max_target_positions` tokens. A sample drawn at the
last position is EOS, so the window ends there; no look-ahead step follows an EOS. A
single-window request never gets there: its budget is at most `max_target_positions -
prompt length` tokens.

Suppression, as transformers applies it: `suppress_tokens` at every sample,
`begin_suppress_tokens` at a window's first sample (`SuppressTokens`, the shared
sampler's logits mask: a candidate table, so the sampling graphs take it); a batch with
a stream decoding timestamps takes `WhisperLogits` instead, which adds the timestamp
rules of `TimestampRules` to those rows (a mask computed per row, so no sampling graph and
no step two ahead for that batch). The
cross-attention slot is written from the window's encoder states the first time the
window runs and kept across preemption (only the self-attention pages are dropped and
recomputed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from omniwalk.engine.attention import PagedAttention
from omniwalk.engine.causal_lm_executor import CausalLMExecutor, SequenceState, TokenHistory
from omniwalk.engine.cross_attention import CrossAttention, CrossAttentionCache
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.host_to_device import to_device
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.engine.sampler import SamplingParams
from omniwalk.engine.sampling_graphs import CandidateTable
from omniwalk.models.whisper.alignment import alignment_weights, token_times
from omniwalk.models.whisper.config import ForcedPrompt, WhisperGenerationConfig
from omniwalk.models.whisper.encoder_graphs import EncoderGraphs
from omniwalk.models.whisper.fallback import window_fails
from omniwalk.models.whisper.features import MelFrames
from omniwalk.models.whisper.modeling import WhisperEncoder, WhisperForConditionalGeneration
from omniwalk.models.whisper.timestamps import TimestampRules, split_window
from omniwalk.runtime.executor import NodeCall, NodeExecutor


class EncoderExecutor(NodeExecutor):
    """Node `encoder`: features [W, mels, frames] -> encoder_states [W, source_len, d].
    Without per-stream state (it may run in a worker process: node_workers.py): the plan
    sends one window a call, so a call's work unit (NodeExecutor's 1) is its window."""

    def __init__(self, encoder: WhisperEncoder, max_windows: int = 16, max_batch_size: int = 256,
                 graphs: EncoderGraphs | None = None):
        self.encoder = encoder
        self.graphs = graphs
        self.max_windows = graphs.max_windows if graphs is not None else max_windows
        self.max_batch_size = max_batch_size
        weight = encoder.conv1.weight
        self.device, self.dtype = weight.device, weight.dtype

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict]:
        # through pinned memory: a copy from pageable memory would first wait for every kernel queued
        features = to_device(torch.cat([call.inputs["features"] for call in calls]), device=self.device).to(self.dtype)
        parts = features.split(self.max_windows)
        # a graph's output is overwritten by its next replay: with several parts each is copied first
        states = self._encode(parts[0]) if len(parts) == 1 else torch.cat([self._encode(p).clone() for p in parts])
        # one request's states must not keep the whole batch alive (nor a graph's output): copies per call
        sizes = [call.inputs["features"].shape[0] for call in calls]
        return [{"encoder_states": part.clone()} for part in states.split(sizes)]

    def _encode(self, features: torch.Tensor) -> torch.Tensor:
        if self.graphs is None:
            return self.encoder(features)
        return self.graphs.run(features)


@dataclass(frozen=True)
class DecoderPrompt:
    """The decoder's prefill input: one window (or one more attempt of it), with its encoder
    states, and the request's frames, forced prompt and temperatures (taken at its first window)."""

    encoder_states: torch.Tensor               # the window's, [source_len, d_model] on the device
    seek: int                                  # the window's first mel frame
    attempt: int                               # decoded at temperatures[attempt]; 0: a new window
    audio: MelFrames
    prompt: ForcedPrompt
    temperatures: tuple[float, ...] = (0.0,)   # a window's attempts (the first: the stream's own)
    align: bool = False                        # token times by cross-attention alignment


@dataclass(frozen=True)
class WindowInfo:
    """Sent with every transcript token: its window (number, first frame, frames of audio
    in it), and the request's language token."""

    index: int
    language: int | None
    seek: int = 0
    num_frames: int = 3000
    attempt: int = 0                # its decoding at temperatures[attempt] (a later one replaces it)
    temperature: float = 0.0
    aligned: "WindowTimes | None" = None    # the token times of a window that ended (or was cut) just now


@dataclass(frozen=True)
class WindowTimes:
    """Word timestamps: the times of one window's tokens (seconds from the window's start),
    sent with the first item after the window ends (or with the window's last item)."""

    index: int
    attempt: int
    times: tuple[float, ...]


@dataclass(frozen=True)
class WindowEnd:
    """What the decoder keeps for the plan when a window ends (its EOS sampled, or its
    context full): the plan decodes it again, starts the next window, or ends the stream
    with `eos` (sent with `info`, which carries the window's word times, if any)."""

    eos: int
    info: WindowInfo
    fails: bool        # its output failed the fallback's checks (checked only while a temperature is left)
    next_seek: int     # where the next window would start (timestamps.py); past the audio: there is none


@dataclass
class TranscriptState(SequenceState):
    """One stream's decoding, across its windows. `token_ids` is the current window's
    sequence (prompt, then fed-back samples); `output_ids` every sample of the stream
    (its length is the sample index)."""

    encoder_states: torch.Tensor | None = None   # the current window's, [S, d]
    audio: MelFrames | None = None
    prompt: ForcedPrompt | None = None
    language: int | None = None          # the language token (given, or once detected)
    window: int = 0
    seek: int = 0                        # the window's first mel frame
    window_start: int = 0                # samples drawn before this window
    cross_window: int | None = None      # the window whose keys/values the cross slot holds
    restarted: bool = False              # a new sequence; the pages still held are the old one's
    temperatures: tuple[float, ...] = (0.0,)
    attempt: int = 0                     # the window's decoding at temperatures[attempt]
    sampling: SamplingParams | None = None   # for attempts after the first (else the stream's)
    logprob_sum: float = 0.0             # of the window's samples (the fallback's check)
    num_logprobs: int = 0
    align: bool = False                  # word timestamps: each window's token times
    aligned: WindowTimes | None = None   # a window's times, until the next item carries them

    @property
    def detecting(self) -> bool:
        return self.language is None and self.prompt.detects_language

    def window_info(self) -> WindowInfo:
        """The window of an item emitted now, with the times of a window that ended, if any."""
        return WindowInfo(self.window, self.language, self.seek, self.audio.window_length(self.seek), self.attempt,
                          self.temperatures[self.attempt], self.aligned)

    def next_info(self) -> WindowInfo:
        """The window of the item emitted now; it carries the times of a window that ended (once)."""
        info, self.aligned = self.window_info(), None
        return info

    @property
    def can_fall_back(self) -> bool:
        return self.attempt + 1 < len(self.temperatures)

    @property
    def window_tokens(self) -> list[int]:
        """The samples of the current window so far."""
        return self.output_ids[self.window_start :]

    def restart(self, token_ids: list[int]) -> None:
        """A phase change: the sequence starts over from position 0."""
        self.token_ids, self.num_computed, self.restarted = token_ids, 0, True

    def start_window(self, prompt: DecoderPrompt, stream_sampling: SamplingParams) -> None:
        """The plan's next window from the forced prompt (attempt 0), or the current one
        again at a later temperature (its output failed the fallback's checks; its
        cross-attention slot stays)."""
        if prompt.attempt == 0:
            self.window += 1
            self.seek, self.encoder_states = prompt.seek, prompt.encoder_states
        self._start_attempt(prompt.attempt, stream_sampling)

    def _start_attempt(self, attempt: int, stream_sampling: SamplingParams) -> None:
        self.attempt = attempt
        self.sampling = None if attempt == 0 else dataclasses.replace(stream_sampling,
                                                                      temperature=self.temperatures[attempt])
        self.window_start = len(self.output_ids)
        self.logprob_sum, self.num_logprobs = 0.0, 0
        self.restart(self.prompt.ids(self.language))


class SuppressTokens:
    """Whisper's logits mask (`LogitsMask` with a candidate table): row 0 of the table
    allows all but `suppress_tokens`, row 1 all but those and `begin_suppress_tokens`
    (a window's first sample). Its columns are the vocabulary itself (no gather)."""

    def __init__(self, generation: WhisperGenerationConfig, vocab: int, device: torch.device,
                 sequences: dict[int, TranscriptState]):
        suppress = _id_mask(vocab, generation.suppress_tokens)
        at_begin = suppress | _id_mask(vocab, generation.begin_suppress_tokens)
        self.table = CandidateTable(None, torch.stack([~suppress, ~at_begin]).to(device))
        self.sequences = sequences   # the executor's

    def candidate_table(self, device: torch.device) -> CandidateTable:
        return self.table

    def candidate_rows(self, calls: list[NodeCall], counts: list[int]) -> list[int]:
        """Row 1 for a window's first sample (`counts`: samples each stream drew so far)."""
        sequences = self.sequences
        return [int(count == sequences[call.stream.handle].window_start) for call, count in zip(calls, counts)]

    def __call__(self, logits: torch.Tensor, calls: list[NodeCall], output_ids: list[list[int]]) -> None:
        rows = self.candidate_rows(calls, [len(ids) for ids in output_ids])
        allowed = self.table.allowed.index_select(0, to_device(rows, torch.long, logits.device))
        logits.masked_fill_(~allowed, float("-inf"))


class WhisperLogits:
    """The logits mask of a batch with a stream decoding timestamps: `SuppressTokens` on
    every row, then `TimestampRules` on those rows (no candidate table: the allowed
    timestamps depend on each row's window so far)."""

    def __init__(self, suppress: SuppressTokens, rules: TimestampRules, sequences: dict[int, TranscriptState]):
        self.suppress = suppress
        self.rules = rules
        self.sequences = sequences   # the executor's

    def __call__(self, logits: torch.Tensor, calls: list[NodeCall], output_ids: list[list[int]]) -> None:
        self.suppress(logits, calls, output_ids)
        states = [self.sequences[call.stream.handle] for call in calls]
        rows = [row for row, state in enumerate(states) if state.prompt.timestamps]
        if rows:
            # `output_ids` may run a step ahead of the state (a look-ahead step): count from them
            self.rules(logits, rows, [output_ids[row][states[row].window_start :] for row in rows])


def _is_last_item(stream) -> bool:
    """Whether the item a stream emits now is the last its budget allows (the runtime counts it next)."""
    return stream.params.max_items is not None and stream.count + 1 >= stream.params.max_items


def _id_mask(vocab: int, ids) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[[i for i in ids if 0 <= i < vocab]] = True
    return mask


class DecoderStep:
    """The decoder as `DecodeGraphs` calls a model: (ids, positions, self-attention,
    cross-attention) -> hidden states, and `compute_logits`."""

    def __init__(self, model: WhisperForConditionalGeneration):
        self.model = model

    def __call__(self, input_ids, positions, attention: PagedAttention, cross: CrossAttention) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, attention, cross)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class DecoderExecutor(CausalLMExecutor):
    """Node `decoder`: `tokens` (a DecoderPrompt at prefill, the last token at decode)
    -> `token`, `window`. See the module docstring for the phases."""

    def __init__(self, model: WhisperForConditionalGeneration, cache: PagedKVCache, cross: CrossAttentionCache,
                 generation: WhisperGenerationConfig, max_batch_size: int = 256, max_cross_writes: int = 8,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None):
        if decode_graphs is not None and decode_graphs.slot_resource is not cross:
            raise ValueError("the decode graphs must read this executor's cross-attention cache")
        if cache.enable_prefix_caching:
            raise ValueError("prefix caching cannot be on for Whisper's decoder: its keys depend on the audio")
        if prefill_graphs is not None and prefill_graphs.slot_resource is not cross:
            raise ValueError("the prefill graphs must read this executor's cross-attention cache")
        super().__init__(model, cache, max_batch_size, decode_graphs=decode_graphs, prefill_graphs=prefill_graphs)
        self.cross = cross
        self.generation = generation
        self.max_cross_writes = max_cross_writes      # windows whose cross K/V are computed at once
        self.max_positions = model.config.max_target_positions
        self.language_ids = torch.tensor(sorted(generation.language_ids), dtype=torch.long, device=self.device)
        self.suppress = self.logits_mask = SuppressTokens(generation, model.config.vocab_size, self.device,
                                                          self.sequences)
        self.with_timestamps = None
        if generation.timestamp_begin is not None:
            rules = TimestampRules(generation.timestamp_begin, generation.no_timestamps_token_id,
                                   min(generation.eos_token_ids), generation.max_initial_timestamp_index)
            self.with_timestamps = WhisperLogits(self.suppress, rules, self.sequences)

    @property
    def streams(self) -> dict[int, TranscriptState]:
        return self.sequences

    # ------------------------------------------------------------ runtime contract

    def begin(self, stream, inputs) -> None:
        tokens = inputs["tokens"]
        if isinstance(tokens, int):      # a decode step: the token sampled last
            super().begin(stream, inputs)
            return
        # the encoder may run on another device, in a worker process (node_workers.py)
        tokens = dataclasses.replace(tokens, encoder_states=tokens.encoder_states.to(self.device))
        state = self.sequences.get(stream.handle)
        if state is not None:            # a later window or attempt: a new sequence (pages: `reserve`)
            state.start_window(tokens, stream.params.sampling)
            self._batch_rows = None      # the row's sampling parameters may have changed
            return
        prompt = tokens.prompt
        first = [prompt.init[0]] if prompt.detects_language else prompt.ids()
        sampling = stream.params.sampling
        history = TokenHistory([]) if sampling is not None and sampling.has_penalties else None
        self.sequences[stream.handle] = TranscriptState(
            token_ids=first, prompt_len=len(first), history=history, encoder_states=tokens.encoder_states,
            seek=tokens.seek, audio=tokens.audio, prompt=prompt, language=prompt.language,
            temperatures=tokens.temperatures, align=tokens.align)

    def can_reserve(self, stream, num_tokens: int) -> bool:
        handle = stream.handle
        if not (self.cross.has(handle) or self.cross.can_allocate()):
            return False
        if self.sequences[handle].restarted:   # its pages are given back first (`reserve`)
            return self.cache.can_reserve_anew(handle, num_tokens)
        return super().can_reserve(stream, num_tokens)

    def reserve(self, stream, num_tokens: int) -> None:
        state = self.sequences[stream.handle]
        if state.restarted:
            self.cache.free(stream.handle)
            state.restarted = False
        super().reserve(stream, num_tokens)
        self.cross.allocate(stream.handle)

    def preempt(self, stream) -> None:
        super().preempt(stream)                 # the cross slot stays: it is not recomputed
        self.sequences[stream.handle].restarted = False

    def release(self, stream) -> None:
        super().release(stream)
        self.cross.free(stream.handle)

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict | None]:
        states = [self.sequences[call.stream.handle] for call in calls]
        # A cross slot written here but not committed below is rewritten next time: same values.
        stale = [i for i, s in enumerate(states) if s.cross_window != s.window]
        if stale:
            self._write_cross([calls[i].stream.handle for i in stale], [states[i] for i in stale])
        written = [(states[i], states[i].window) for i in stale]
        # the timestamp rules' mask for a batch that needs it (the look-ahead step launched
        # at the end of this run samples its rows with the same)
        timestamps = any(state.prompt.timestamps for state in states)
        self.logits_mask = self.with_timestamps if timestamps else self.suppress
        detect = [i for i, s in enumerate(states) if s.detecting]
        results = self._run_with_detection(calls, states, detect) if detect else super().run(calls)
        for state, window in written:   # the window written (the step may have started the next one)
            state.cross_window = window
        return results

    def _run_with_detection(self, calls: list[NodeCall], states: list[TranscriptState],
                            detect: list[int]) -> list[dict | None]:
        """Language detection ([sot] alone) beside the shared step of the other calls:
        argmax over the language ids whatever the temperature (as transformers), no sample."""
        detect_calls, detect_states = [calls[i] for i in detect], [states[i] for i in detect]
        # [sot] alone is a decode step's shape: a decode graph computes it where one fits,
        # instead of an eager pass over every layer. Not while a look-ahead step is in flight:
        # DecodeGraphs alternates two sets of pinned staging a step, and this extra replay
        # would write the set its copies may still read. (Not measured on a GPU: the ASR
        # bench names the language.)
        if self.lookahead is None and self._graph_rows(detect_calls, list(range(len(detect)))):
            logits = self._decode_with_graph(detect_calls, detect_states)
        else:
            logits = self._forward_eager(detect_calls, detect_states, list(range(len(detect))))
        languages = self.language_ids[logits[:, self.language_ids].argmax(dim=-1)].tolist()
        results: list[dict | None] = [None] * len(calls)
        skip = set(detect)
        rest = [i for i in range(len(calls)) if i not in skip]
        if rest:
            for i, result in zip(rest, super().run([calls[i] for i in rest])):
                results[i] = result
        # committed once the whole step succeeded: window 0 starts over with its full prompt
        for i, language in zip(detect, languages):
            states[i].language = language
            states[i].restart(states[i].prompt.ids(language))
        return results

    def _record_samples(self, calls, sequences, rows, sampled, seen_tokens):
        eos_of = [calls[index].stream.params.stop.eos_ids for index in rows]
        forced = set()
        for k, index in enumerate(rows):
            if len(sequences[index].token_ids) >= self.max_positions:   # the window's context is full: it ends
                sampled[k] = (min(eos_of[k]), None)
                forced.add(index)
        results, _ = super()._record_samples(calls, sequences, rows, sampled, seen_tokens)
        ended = set()
        for index, eos_ids in zip(rows, eos_of):
            state, result = sequences[index], results[index]
            if result["logprobs"] is not None:   # a stream with a fallback asks for them
                state.logprob_sum += result["logprobs"].logprob
                state.num_logprobs += 1
            if result["token"] not in eos_ids:
                if state.align and _is_last_item(calls[index].stream):   # the budget cuts the window here
                    self._align(state, state.window_tokens)
                result["window"], result["window_end"] = state.next_info(), None
                continue
            ended.add(index)
            result["window"], result["window_end"] = None, self._end_window(state, result["token"], index in forced)
        return results, ended

    def _end_window(self, state: TranscriptState, eos: int, forced: bool) -> WindowEnd:
        """The EOS that ends a window (`forced`: it is not a sample, the context was full),
        not emitted here: what the plan decides the next walk from. The window's word
        times are aligned now, unless it is decoded again."""
        tokens = state.window_tokens
        checked = tokens[:-1] if forced else tokens
        fails = state.can_fall_back and window_fails(checked, state.logprob_sum, state.num_logprobs,
                                                     self.model.config.vocab_size)
        if state.align and not fails:
            self._align(state, checked)
        return WindowEnd(eos, state.window_info(), fails, state.seek + self._window_advance(state, tokens[:-1]))

    def _align(self, state: TranscriptState, tokens: list[int]) -> None:
        """The window's token times (`tokens`: its samples, an EOS sampled included), for
        the next item to carry. One eager decoder pass over the window (alignment.py)."""
        prompt = state.prompt.ids(state.language)
        heads = self.generation.alignment_heads
        weights = alignment_weights(self.model.decoder, state.encoder_states, prompt + tokens[:-1], heads)
        times = token_times(weights[:, len(prompt):], len(tokens), state.audio.window_audio_frames(state.seek),
                            self.model.config.median_filter_width)
        state.aligned = WindowTimes(state.window, state.attempt, tuple(times))

    def _sampling_params(self, call: NodeCall) -> SamplingParams:
        return self.sequences[call.stream.handle].sampling or call.stream.params.sampling

    def _window_advance(self, state: TranscriptState, tokens: list[int]) -> int:
        """Mel frames from the window's start to the next one's (tokens: the window's, no EOS)."""
        num_frames = state.audio.window_length(state.seek)
        if not state.prompt.timestamps:
            return num_frames
        return split_window(tokens, state.seek, num_frames, self.generation.timestamp_begin)[1]

    def _row_slots(self, handles: list[int]) -> list[tuple[int]]:
        return [self.cross.row_slots(h) for h in handles]

    # a stream's cross-attention slot holds its window's encoder states until the window
    # ends (a new window's are written in order on the same CUDA stream, after any step
    # launched before them), so decode steps may be launched two ahead
    row_slots_fixed = True

    def _eager_inputs(self, handles: list[int], query_lens: list[int]) -> tuple:
        return (CrossAttention(self.cross, handles, query_lens),)

    def _write_cross(self, handles: list[int], states: list[TranscriptState]) -> None:
        # layer by layer straight into the slots (stacking every layer's keys first cost two
        # copies of ~250 MB a window on large-v3)
        step = self.max_cross_writes
        layers = self.model.decoder.layers
        for start in range(0, len(handles), step):
            slots = self.cross.slot_index(handles[start : start + step])
            encoder_states = torch.stack([state.encoder_states for state in states[start : start + step]])
            for layer in layers:
                self.cross.write_layer(layer.index, slots, *layer.encoder_attn.key_value(encoder_states))
