"""The speaking nodes: `talker` (the Talker with its code predictor inside each step) and
`code2wav` (frames to 24 kHz samples).

The Talker's sequence is a list of input rows (embeddings) over a paged KV cache of its
own: the prompt's rows (`talker_prompt.py`), then one row per step, made from the frame the
step before produced and the step's text (`trailing_id`), once that text is written (the
talker stream follows the answer token by token: `begin` learns the step's text when a step
comes, and `run` builds the rows of all its calls' new steps at once).
A call computes its stream's next rows (prefill chunks, or the one new row) and, at the
last one, samples the frame:

    hidden = talker(rows, positions, attention)               [rows, hidden]
    c0     = sample(codec_head(hidden[last]) without the specials but codec EOS)
    c0 == codec EOS:  the step's item is the EOS id (counted, stops the stream, never audio)
    else:             codes c1 .. c(G-1) from the code predictor; the item is the frame;
                      the next row = the G codes' summed embeddings + the step's text row

The rows stay with the sequence (a preempted stream recomputes its KV from them). The first
code is sampled by the engine's `Sampler` (penalties over the stream's first codes, seeded
by (seed, step)); the residual codes by the same stage functions inside the code
predictor's loop (`residual_graphs.py`: one CUDA graph per batch bucket), each group with
its own sample index, with the code predictor's settings (top-k 50, top-p 0.8 when the
Talker samples; greedy when it is greedy), so a request's audio depends on its seed alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from omniwalk.engine.attention import PagedAttention, build_metadata
from omniwalk.engine.host_to_device import to_device
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.sampler import Sampler
from omniwalk.engine.seen_tokens import SeenTokens
from omniwalk.graph import Chunk
from omniwalk.models.qwen3_omni.code2wav import Code2Wav, CodecChunk
from omniwalk.models.qwen3_omni.positions import PromptPositions
from omniwalk.models.qwen3_omni.residual_graphs import ResidualGraphs
from omniwalk.models.qwen3_omni.talker_graphs import TalkerDecodeGraphs
from omniwalk.models.qwen3_omni.talker import Talker
from omniwalk.models.qwen3_omni.talker_prompt import TalkerPrompt, prompt_rows, text_rows, trailing_id
from omniwalk.runtime.executor import NodeCall, NodeExecutor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TalkerStart:
    """The talker stream's first walk: its prompt (with the answer's text written so far);
    for a prompt with media, the Thinker's hidden states at its media rows ([m, Ht], in
    `prompt.media_positions` order) and, with images, its rotary positions
    (`talker_positions`; None: row i at position i)."""

    prompt: TalkerPrompt
    text_ended: bool
    media_hidden: torch.Tensor | None = None
    positions: PromptPositions | None = None


@dataclass(frozen=True)
class TextMore:
    """A step for a new token of the answer (`ended`: the last one)."""

    ids: tuple[int, ...]
    ended: bool = False


@dataclass(frozen=True)
class TextEnd:
    """The answer is complete: the decode loop's steps read tts_eos, then tts_pad."""


#: how many ids' text rows a `TalkerExecutor` keeps (`_text_row`; 2 KB each at the full
#: shape: 32 MB), of the Thinker's 152k
TEXT_ROW_CACHE_IDS = 16384


@dataclass
class TalkerSequence:
    prompt: TalkerPrompt
    prompt_rows: torch.Tensor            # [len(prompt), hidden]
    trailing: list[int]                  # the decode steps' text as far as written (`trailing_id`)
    text_ended: bool = False
    # [1, hidden] per decode step: its frame's summed embeddings plus its text's row. Rows
    # apart, not one growing tensor: appending to that copied the whole sequence each step.
    step_rows: list[torch.Tensor] = field(default_factory=list)
    step_text: int | None = None         # the next step's text id, known to `begin`; `run` builds its row
    num_computed: int = 0                # rows whose keys and values are in the cache
    first_codes: list[int] = field(default_factory=list)   # one per frame: the penalties' history
    frame_embeds: torch.Tensor | None = None   # the last frame's summed embeddings, until its step's text is known
    rope: np.ndarray | None = None       # [3, len(prompt)] (t, h, w) of the prompt's rows (images); None: plain
    rope_offset: int = 0                 # a row past the prompt: rotary position = row + rope_offset

    @property
    def step(self) -> int:
        """Decode steps taken: frames fed back as rows (the one whose row `run` builds too)."""
        return len(self.step_rows) + (self.step_text is not None)

    @property
    def num_rows(self) -> int:
        return len(self.prompt_rows) + self.step

    def rows(self, start: int, count: int) -> torch.Tensor:
        """Input rows [start, start + count) ([count, hidden]), all built."""
        prompt_len = len(self.prompt_rows)
        if start >= prompt_len and count == 1:   # a decode step's row: no copy
            return self.step_rows[start - prompt_len]
        parts = [self.prompt_rows[start : start + count]] if start < prompt_len else []
        parts += self.step_rows[max(0, start - prompt_len) : max(0, start + count - prompt_len)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class TalkerExecutor(NodeExecutor):
    """Node `talker`: `inputs=("codes",)` (a TalkerPrompt to prefill, then each frame),
    `outputs=("frame",)`: a tuple of G codes, or the codec EOS id that ended the stream."""

    chunkable = True

    def __init__(self, talker: Talker, thinker_embeddings: torch.nn.Embedding, cache: PagedKVCache,
                 max_batch_size: int = 256, graphs: bool = True):
        """`graphs`: decode steps and the code predictor's loop through `TalkerDecodeGraphs` and
        `ResidualGraphs` (captured on CUDA; on a CPU the same functions over the same
        buffers); False (--enforce-eager): eager steps."""
        self.talker = talker
        self.thinker_embeddings = thinker_embeddings
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.config = talker.config
        self.device = next(talker.parameters()).device
        self.sampler = Sampler()
        # the first codes each stream said, on the device for the repetition penalty (made on
        # first use): rebuilt from the histories, a step's host work grew with every frame
        self.seen_codes: SeenTokens | None = None
        self.sequences: dict[int, TalkerSequence] = {}
        self.text_row_cache: dict[int, torch.Tensor] = {}   # id -> its decode steps' text row (`_text_row`)
        self.suppressed = torch.tensor(self.config.suppressed_codec_ids, dtype=torch.long, device=self.device)
        self.residual_graphs = ResidualGraphs(talker, max_batch_size, self.device, self.talker_dtype, capture=graphs)
        self.decode_graphs = None
        if graphs:
            self.decode_graphs = TalkerDecodeGraphs(talker, cache, max_batch_size, self.talker_dtype)
            try:
                self.decode_graphs.capture()
            except Exception:   # speak with eager steps (slower, the same frames) rather than not at all
                logger.exception("could not capture the Talker's decode graphs: its steps run eagerly")
                self.decode_graphs = None

    # ------------------------------------------------------------ per-stream state

    def begin(self, stream, inputs) -> None:
        codes = inputs["codes"]
        if isinstance(codes, TalkerStart):
            prompt, positions = codes.prompt, codes.positions
            sequence = TalkerSequence(prompt, self._prompt_rows(prompt, codes.media_hidden),
                                      list(prompt.trailing_ids), codes.text_ended)
            if positions is not None and positions.rope is not None:
                sequence.rope, sequence.rope_offset = positions.rope, positions.offset
            self.sequences[stream.handle] = sequence
            return
        sequence = self.sequences[stream.handle]
        if isinstance(codes, TextMore):
            sequence.trailing.extend(codes.ids)
            sequence.text_ended = codes.ended
        elif isinstance(codes, TextEnd):
            sequence.text_ended = True
        if sequence.frame_embeds is not None and sequence.step_text is None:
            # the step's row: the last frame and the step's text, built by `run` with the batch's
            # others (the few small ops of one row cost the host more than the GPU takes for them)
            sequence.step_text = trailing_id(sequence.trailing, sequence.step, self.config.prompt,
                                             sequence.text_ended)

    def pending_work(self, stream) -> int:
        sequence = self.sequences[stream.handle]
        return sequence.num_rows - sequence.num_computed

    def can_reserve(self, stream, num_tokens: int) -> bool:
        return self.cache.can_reserve(stream.handle, self.sequences[stream.handle].num_computed + num_tokens)

    def reserve(self, stream, num_tokens: int) -> None:
        self.cache.reserve(stream.handle, self.sequences[stream.handle].num_computed + num_tokens)

    def holds_state(self, stream) -> bool:
        return bool(self.cache.page_tables.get(stream.handle))

    def preempt(self, stream) -> None:
        self.cache.free(stream.handle)
        self.sequences[stream.handle].num_computed = 0   # the rows are kept: recomputed when it runs again

    def release(self, stream) -> None:
        self.cache.free(stream.handle)
        self.sequences.pop(stream.handle, None)
        if self.seen_codes is not None:
            self.seen_codes.free(stream.handle)

    # ------------------------------------------------------------ rows

    @torch.inference_mode()
    def _prompt_rows(self, prompt: TalkerPrompt, media_hidden: torch.Tensor | None) -> torch.Tensor:
        if media_hidden is not None:
            media_hidden = media_hidden.to(self.device)
        return prompt_rows(self.talker, self.thinker_embeddings, prompt, media_hidden)

    def _text_row(self, token_id: int) -> torch.Tensor:
        """A decode step's text row [1, hidden]: the same for every step that reads the id, so
        kept (up to TEXT_ROW_CACHE_IDS ids) rather than projected again at each; projected
        alone, as before it was kept (a batch of rows could round differently)."""
        row = self.text_row_cache.get(token_id)
        if row is None:
            row = text_rows(self.talker, self.thinker_embeddings, [token_id])
            if len(self.text_row_cache) < TEXT_ROW_CACHE_IDS:
                self.text_row_cache[token_id] = row
        return row

    def _build_step_rows(self, sequences: list[TalkerSequence]) -> None:
        """The rows of the steps `begin` gave their text: the last frame's summed embeddings
        plus the text's row, for all of them in one add. Built before anything that could
        fail, and the same whenever built: a batch retried call by call finds them made."""
        waiting = [s for s in sequences if s.step_text is not None]
        if not waiting:
            return
        text = torch.cat([self._text_row(s.step_text) for s in waiting])
        rows = torch.stack([s.frame_embeds for s in waiting]).to(text.dtype) + text
        for sequence, row in zip(waiting, rows.split(1)):
            sequence.step_rows.append(row)
            sequence.step_text = sequence.frame_embeds = None

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict | None]:
        sequences = [self.sequences[call.stream.handle] for call in calls]
        self._build_step_rows(sequences)
        handles = [call.stream.handle for call in calls]
        starts = [s.num_computed for s in sequences]
        counts = [call.num_tokens for call in calls]
        rows = torch.cat([s.rows(a, n) for s, a, n in zip(sequences, starts, counts)])
        tables = [self.cache.page_tables[h] for h in handles]
        graphs = self.decode_graphs
        if (graphs is not None and all(s.rope is None and a > 0 and n == 1 and a + 1 == s.num_rows
                                       for s, a, n in zip(sequences, starts, counts))
                and graphs.fits(len(calls), max(len(t) for t in tables))):
            # a decode step: each stream's one new row (text positions), its frame sampled now
            logits, last = graphs.step(rows.to(self.talker_dtype), starts, tables)
            frames = self._frames(calls, sequences, last, logits)
            return self._commit(calls, sequences, counts, range(len(calls)), frames)
        if all(s.rope is None for s in sequences):
            positions = torch.tensor([p for a, n in zip(starts, counts) for p in range(a, a + n)], device=self.device)
        else:   # a prompt with images: (t, h, w) positions
            rope = [_rope_of(s, a, n) for s, a, n in zip(sequences, starts, counts)]
            positions = torch.from_numpy(np.concatenate(rope, axis=1)).to(self.device)
        metadata = build_metadata(self.cache, handles, starts, counts, self.device)
        hidden = self.talker(rows.to(self.talker_dtype), positions, PagedAttention(self.cache, metadata))
        ends = np.cumsum(counts) - 1
        done = [i for i, (s, a, n) in enumerate(zip(sequences, starts, counts)) if a + n == s.num_rows]
        frames = []
        if done:
            last = hidden[torch.tensor(ends[done], device=self.device)]
            frames = self._frames([calls[i] for i in done], [sequences[i] for i in done], last)
        return self._commit(calls, sequences, counts, done, frames)

    def _commit(self, calls: list[NodeCall], sequences: list[TalkerSequence], counts: list[int], done,
                frames) -> list[dict | None]:
        """Only now, once the batch computed: a batch that raised left every sequence as it was."""
        outputs: list[dict | None] = [None] * len(sequences)
        for sequence, n in zip(sequences, counts):
            sequence.num_computed += n
        for i, (item, frame_embeds) in zip(done, frames):
            outputs[i] = {"frame": item}
            first = item[0] if isinstance(item, tuple) else item
            sequences[i].first_codes.append(first)
            if self.seen_codes is not None:
                self.seen_codes.append(calls[i].stream.handle, first)
            sequences[i].frame_embeds = frame_embeds   # the next step's row, once its text is known (`begin`)
        return outputs

    def _seen_codes(self, calls: list[NodeCall], sequences: list[TalkerSequence], params,
                    vocab: int) -> torch.Tensor | None:
        """[n, vocab] bool: the first codes each row said so far, for a batch with a repetition
        penalty (None without one: the sampler reads no history then)."""
        if all(p.sampling.repetition_penalty == 1.0 for p in params):
            return None
        if self.seen_codes is None:
            self.seen_codes = SeenTokens(vocab, self.device, capacity=self.max_batch_size)
        histories = [_CodeHistory(s.first_codes) for s in sequences]
        rows = self.seen_codes.rows([call.stream.handle for call in calls], histories)
        return self.seen_codes.mask.index_select(0, rows)

    @property
    def talker_dtype(self) -> torch.dtype:
        return next(self.talker.parameters()).dtype

    def _frames(self, calls: list[NodeCall], sequences: list[TalkerSequence], last_hidden: torch.Tensor,
                logits: torch.Tensor | None = None):
        """(item, its summed codec embeddings or None) of each finished call: its frame, or codec
        EOS. `logits`: the codec head's over `last_hidden`, if a graph step computed them."""
        params = [call.stream.params for call in calls]
        logits = self.talker.compute_logits(last_hidden) if logits is None else logits
        logits.index_fill_(1, self.suppressed, float("-inf"))
        endless = [i for i, p in enumerate(params) if p.stop.ignore_eos]
        if endless:   # exactly the frame budget: codec EOS may not be picked either
            logits[to_device(endless, dtype=torch.long, device=self.device), self.config.codec.eos] = float("-inf")
        first = self.sampler(logits, [p.sampling for p in params], [p.seed for p in params],
                             [s.step * self.config.num_code_groups for s in sequences],
                             [[] for _ in sequences], [s.first_codes for s in sequences],
                             seen=self._seen_codes(calls, sequences, params, logits.shape[1])).token_ids
        # Every row's code predictor runs, codec EOS or not (an EOS row's frame is dropped):
        # asking the host first which rows speak waited for the step there, and the GPU
        # idled while the host prepared the code predictor (~1.5 ms a step at batch 8 on the H200).
        frame = self.residual_graphs.run(last_hidden, first, [p.sampling for p in params], [p.seed for p in params],
                                         [s.step for s in sequences])
        eos = self.config.codec.eos
        return [(eos, None) if codes[0] == eos else (tuple(codes), frame.summed_embeds[k])
                for k, codes in enumerate(frame.codes.tolist())]


class _CodeHistory(NamedTuple):
    """A stream's history as `SeenTokens` reads it when it gives the stream a row: no prompt
    (the Talker's prompt is embeddings), its first codes."""

    outputs: list[int]
    prompt: tuple = ()


def _rope_of(sequence: TalkerSequence, start: int, count: int) -> np.ndarray:
    """[3, count] rotary positions of rows [start, start + count): the prompt's own, then row + offset."""
    end = start + count
    if sequence.rope is None:
        return np.broadcast_to(np.arange(start, end), (3, count))
    split = max(start, min(end, sequence.rope.shape[1]))
    tail = np.broadcast_to(np.arange(split, end) + sequence.rope_offset, (3, end - split))
    return np.concatenate([sequence.rope[:, start:split], tail], axis=1)


class Code2WavExecutor(NodeExecutor):
    """Node `code2wav`: `frames` (a chunk of the talker stream: left-context frames, then new
    ones) -> `pcm`: the int16 samples those new frames made final.

    A step decodes all its calls' chunks together (`Code2Wav.decode_chunks`: one transformer
    pass, a conv pass for the full-context chunks and one per length for a stream's first
    ones), each call's samples as its chunk alone would give them."""

    def __init__(self, code2wav: Code2Wav, max_batch_size: int = 64):
        self.code2wav = code2wav
        self.max_batch_size = max_batch_size

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict]:
        chunks = []
        for call in calls:
            chunk: Chunk = call.inputs["frames"]
            context = len(chunk.items) - chunk.num_new
            # [Q, frames] on the host: decode_chunks pads the step's chunks there, then copies them over at once
            codes = torch.tensor(chunk.items, dtype=torch.long).T
            chunks.append(CodecChunk(codes, chunk.start + context, context))
        wavs = self.code2wav.decode_chunks(chunks)
        # one conversion and one copy to the host for the whole step, then split per call
        pcm = (torch.cat(wavs).float() * 32767).round().to(torch.int16).cpu().numpy()
        bounds = np.cumsum([0] + [w.shape[-1] for w in wavs])
        return [{"pcm": pcm[a:b].tobytes()} for a, b in zip(bounds[:-1], bounds[1:])]
