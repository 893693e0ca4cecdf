"""The two nodes of Whisper: a stateless encoder and the stateful decoder.

Encoder: a batch stacks the windows of all its calls ([sum W, mels, 3000]) and runs
them `max_windows` at a time; each call gets its own [W, 1500, d] states back.

Decoder: per stream, the windows' encoder states, a cross-attention slot, and the token
sequence of the window being decoded (paged self-attention KV). What a call does when
its last position is computed depends on the stream's phase:

    phase            sequence (token_ids)                  at the last position
    detect language  [sot]                                 argmax over language ids; the
                                                           sequence becomes window 0's prompt
    window w         prompt, then fed-back samples         sample; emit it, unless it is
                                                           EOS and w is not the last window:
                                                           then window w + 1 starts

    window 0: [prev.. sot en transcribe notimestamps] t0 t1 t2 EOS    (EOS swallowed)
    window 1: [prev.. sot en transcribe notimestamps] u0 u1 EOS       (EOS emitted: stop)
    client:   t0 t1 t2 u0 u1 EOS        -- the budget counts these items

A phase change ends the call without outputs (None); the runtime keeps the stream at
the node and the next step computes the new sequence (chunked like any prefill). The
EOS ending a window that is not the last is the one sample never emitted: the runtime's
stop would end the whole stream at it.

A window's decoder context holds `max_target_positions` tokens. When a sample would be
drawn at the last position, only EOS may be sampled, so the window ends there (the next
window starts, or the last window stops). A single-window request never gets there:
its budget is at most `max_target_positions - prompt length` tokens.

Suppression, as transformers applies it: `suppress_tokens` at every sample,
`begin_suppress_tokens` at a window's first sample. The cross-attention slot is written
from the window's encoder states the first time the window runs and kept across
preemption (only the self-attention pages are dropped and recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omniwalk.engine.attention import PagedAttention, build_metadata
from omniwalk.engine.cross_attention import CrossAttention, CrossAttentionCache
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.sampler import Sampler
from omniwalk.models.whisper.config import ForcedPrompt, WhisperGenerationConfig
from omniwalk.models.whisper.modeling import WhisperEncoder, WhisperForConditionalGeneration
from omniwalk.runtime.executor import NodeCall, NodeExecutor


class EncoderExecutor(NodeExecutor):
    """Node `encoder`: features [W, mels, frames] -> encoder_states [W, source_len, d]."""

    def __init__(self, encoder: WhisperEncoder, max_windows: int = 16, max_batch_size: int = 256):
        self.encoder = encoder
        self.max_windows = max_windows
        self.max_batch_size = max_batch_size
        weight = encoder.conv1.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.num_windows: dict[int, int] = {}

    def begin(self, stream, inputs) -> None:
        self.num_windows[stream.handle] = inputs["features"].shape[0]

    def pending_work(self, stream) -> int:
        return self.num_windows[stream.handle]     # work units: windows

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict]:
        features = torch.cat([call.inputs["features"] for call in calls]).to(self.device, self.dtype)
        states = torch.cat([self.encoder(part) for part in features.split(self.max_windows)])
        # one request's states must not keep the whole batch alive: copies per call
        sizes = [call.inputs["features"].shape[0] for call in calls]
        return [{"encoder_states": part.clone()} for part in states.split(sizes)]

    def release(self, stream) -> None:
        self.num_windows.pop(stream.handle, None)


@dataclass(frozen=True)
class DecoderPrompt:
    """The decoder's prefill input: the request's encoder states and its forced prompt."""

    encoder_states: torch.Tensor     # [num_windows, source_len, d_model] on the device
    prompt: ForcedPrompt


@dataclass(frozen=True)
class WindowInfo:
    """Sent with every transcript token: its window, and the request's language token."""

    index: int
    language: int | None


@dataclass
class TranscriptState:
    """One stream's decoding, across its windows."""

    encoder_states: torch.Tensor
    prompt: ForcedPrompt
    language: int | None                 # the language token (given, or once detected)
    token_ids: list[int]                 # the current window's sequence: prompt, then fed-back samples
    window: int = 0
    num_computed: int = 0
    window_samples: list[int] = field(default_factory=list)   # sampled in this window
    num_samples: int = 0                 # sampler draws of the stream: the sample index
    cross_window: int | None = None      # the window whose keys/values the cross slot holds

    @property
    def detecting(self) -> bool:
        return self.language is None and self.prompt.detects_language

    @property
    def is_last_window(self) -> bool:
        return self.window == self.encoder_states.shape[0] - 1

    @property
    def info(self) -> WindowInfo:
        return WindowInfo(self.window, self.language)


# What the last position of a finished call decided.
LANGUAGE, NEXT_WINDOW, TOKEN = "language", "next_window", "token"


class DecoderStep:
    """The decoder as `DecodeGraphs` calls a model: (ids, positions, self-attention,
    cross-attention) -> hidden states, and `compute_logits`."""

    def __init__(self, model: WhisperForConditionalGeneration):
        self.model = model

    def __call__(self, input_ids, positions, attention: PagedAttention, cross: CrossAttention) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, attention, cross)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class DecoderExecutor(NodeExecutor):
    """Node `decoder`: `tokens` (a DecoderPrompt at prefill, the last token at decode)
    -> `token`, `window`. See the module docstring for the phases."""

    chunkable = True

    def __init__(self, model: WhisperForConditionalGeneration, cache: PagedKVCache, cross: CrossAttentionCache,
                 generation: WhisperGenerationConfig, max_batch_size: int = 256, max_cross_writes: int = 8,
                 decode_graphs: DecodeGraphs | None = None):
        if decode_graphs is not None and decode_graphs.slot_resource is not cross:
            raise ValueError("the decode graphs must read this executor's cross-attention cache")
        self.model = model
        self.decode_graphs = decode_graphs
        self.cache = cache
        self.cross = cross
        self.generation = generation
        self.max_batch_size = max_batch_size
        self.max_cross_writes = max_cross_writes      # windows whose cross K/V are computed at once
        self.max_positions = model.config.max_target_positions
        self.device = model.decoder.embed_tokens.weight.device
        self.sampler = Sampler()
        self.streams: dict[int, TranscriptState] = {}
        vocab = model.config.vocab_size
        self.language_ids = torch.tensor(sorted(generation.language_ids), dtype=torch.long, device=self.device)
        self.suppress = self._mask(vocab, generation.suppress_tokens)
        self.suppress_at_begin = self.suppress | self._mask(vocab, generation.begin_suppress_tokens)

    def _mask(self, vocab: int, ids) -> torch.Tensor:
        mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        mask[[i for i in ids if 0 <= i < vocab]] = True
        return mask

    # ------------------------------------------------------------ runtime contract

    def begin(self, stream, inputs) -> None:
        tokens = inputs["tokens"]
        if isinstance(tokens, int):      # a decode step: the token sampled last
            self.streams[stream.handle].token_ids.append(tokens)
            return
        prompt = tokens.prompt
        first = [prompt.init[0]] if prompt.detects_language else prompt.ids()
        self.streams[stream.handle] = TranscriptState(tokens.encoder_states, prompt, prompt.language, first)

    def pending_work(self, stream) -> int:
        state = self.streams[stream.handle]
        return len(state.token_ids) - state.num_computed

    def can_reserve(self, stream, num_tokens: int) -> bool:
        handle = stream.handle
        has_slot = self.cross.has(handle) or self.cross.can_allocate()
        return has_slot and self.cache.can_reserve(handle, self.streams[handle].num_computed + num_tokens)

    def reserve(self, stream, num_tokens: int) -> None:
        self.cross.allocate(stream.handle)
        self.cache.reserve(stream.handle, self.streams[stream.handle].num_computed + num_tokens)

    def holds_state(self, stream) -> bool:
        return bool(self.cache.page_tables.get(stream.handle))

    def preempt(self, stream) -> None:
        self.cache.free(stream.handle)
        self.streams[stream.handle].num_computed = 0    # the cross slot stays: it is not recomputed

    def release(self, stream) -> None:
        self.cache.free(stream.handle)
        self.cross.free(stream.handle)
        self.streams.pop(stream.handle, None)

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict | None]:
        states = [self.streams[call.stream.handle] for call in calls]
        # A cross slot written here but not committed below is rewritten next time: same values.
        stale = [i for i, s in enumerate(states) if s.cross_window != s.window]
        self._write_cross([calls[i].stream.handle for i in stale], [states[i] for i in stale])
        done = [i for i, (call, s) in enumerate(zip(calls, states))
                if s.num_computed + call.num_tokens == len(s.token_ids)]
        if self._fits_graph(calls, states, done, stale):
            logits = self._decode_with_graph(calls, states)
        else:
            logits = self._forward(calls, states, done)
        decisions = self._decide([calls[i] for i in done], [states[i] for i in done], logits) if done else []

        # Commit only after everything succeeded: a failed batch is retried call by call.
        for i in stale:
            states[i].cross_window = states[i].window
        for call, state in zip(calls, states):
            state.num_computed += call.num_tokens
        results: list[dict | None] = [None] * len(calls)
        for i, (kind, value) in zip(done, decisions):
            results[i] = self._commit(calls[i].stream.handle, states[i], kind, value)
        return results

    def _fits_graph(self, calls, states, done, stale) -> bool:
        """Only decode steps (one token each, cross keys already written) replay a graph."""
        return (self.decode_graphs is not None and not stale and len(done) == len(calls)
                and all(call.num_tokens == 1 for call in calls)
                and self.decode_graphs.fits(len(calls), max(len(self.cache.page_tables[c.stream.handle])
                                                             for c in calls)))

    def _decode_with_graph(self, calls: list[NodeCall], states: list[TranscriptState]) -> torch.Tensor:
        handles = [call.stream.handle for call in calls]
        positions = [s.num_computed for s in states]
        size = self.cache.page_size
        tables = [self.cache.page_tables[h] for h in handles]
        return self.decode_graphs.run(
            input_ids=[s.token_ids[-1] for s in states], positions=positions,
            slots=[table[p // size] * size + p % size for table, p in zip(tables, positions)],
            context_lens=positions, page_tables=tables, row_slots=[self.cross.row_slots(h) for h in handles],
        )   # [rows, vocab] fp32

    def _write_cross(self, handles: list[int], states: list[TranscriptState]) -> None:
        step = self.max_cross_writes
        for start in range(0, len(handles), step):
            part = states[start : start + step]
            encoder_states = torch.stack([s.encoder_states[s.window] for s in part])   # [n, S, d]
            keys, values = self.model.decoder.cross_key_values(encoder_states)
            self.cross.write(handles[start : start + step], keys, values)

    def _forward(self, calls: list[NodeCall], states: list[TranscriptState], done: list[int]) -> torch.Tensor:
        input_ids, positions = [], []
        for call, state in zip(calls, states):
            start = state.num_computed
            input_ids.extend(state.token_ids[start : start + call.num_tokens])
            positions.extend(range(start, start + call.num_tokens))
        handles = [call.stream.handle for call in calls]
        query_lens = [call.num_tokens for call in calls]
        metadata = build_metadata(self.cache, handles, [s.num_computed for s in states], query_lens, self.device)
        hidden = self.model.decoder(
            torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True),
            PagedAttention(self.cache, metadata),
            CrossAttention(self.cross, handles, query_lens),
        )  # [num_tokens, d]
        ends = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.compute_logits(hidden[ends[done].to(self.device)])   # [num_done, vocab] fp32

    def _decide(self, calls: list[NodeCall], states: list[TranscriptState], logits: torch.Tensor):
        detect = [row for row, s in enumerate(states) if s.detecting]
        sample = [row for row, s in enumerate(states) if not s.detecting]
        decisions: list[tuple[str, int]] = [("", 0)] * len(states)
        if detect:   # argmax over the language tokens, whatever the temperature (as transformers)
            choice = logits[detect][:, self.language_ids].argmax(dim=-1)
            for row, language in zip(detect, self.language_ids[choice].tolist()):
                decisions[row] = (LANGUAGE, language)
        if sample:
            tokens = self._sample([calls[r] for r in sample], [states[r] for r in sample], logits[sample])
            for row, token in zip(sample, tokens):
                state = states[row]
                ends_window = token in calls[row].stream.params.stop.eos_ids
                decisions[row] = (NEXT_WINDOW if ends_window and not state.is_last_window else TOKEN, token)
        return decisions

    def _sample(self, calls: list[NodeCall], states: list[TranscriptState], logits: torch.Tensor) -> list[int]:
        # logits: [rows, vocab] float32, masked in place
        first = torch.tensor([not s.window_samples for s in states], device=self.device)
        mask = torch.where(first[:, None], self.suppress_at_begin[None], self.suppress[None])
        logits.masked_fill_(mask, float("-inf"))
        for row, (call, state) in enumerate(zip(calls, states)):
            if len(state.token_ids) >= self.max_positions:   # the window's context is full: it ends
                eos = min(call.stream.params.stop.eos_ids)
                logits[row].fill_(float("-inf"))
                logits[row, eos] = 0.0
        out = self.sampler(
            logits, [call.stream.params.sampling for call in calls],
            seeds=[call.stream.params.seed for call in calls],
            sample_indices=[s.num_samples for s in states],
            prompt_token_ids=[[] for _ in states],
            output_token_ids=[s.window_samples for s in states],
        )
        return out.token_ids.tolist()   # the one device-to-host copy of the step

    def _commit(self, handle: int, state: TranscriptState, kind: str, value: int) -> dict | None:
        if kind == LANGUAGE:             # window 0 starts over with its full prompt
            state.language = value
            state.token_ids, state.num_computed = state.prompt.ids(value), 0
            return None
        state.num_samples += 1
        if kind == NEXT_WINDOW:
            state.window += 1
            state.token_ids, state.num_computed, state.window_samples = state.prompt.ids(state.language), 0, []
            # the old window's pages go back; the new prompt's come out of them (never more:
            # the old sequence held at least the prompt), so the stream keeps holding state
            self.cache.free(handle)
            self.cache.reserve(handle, len(state.token_ids))
            return None
        state.window_samples.append(value)
        return {"token": value, "window": state.info}
