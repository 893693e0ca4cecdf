"""Runs batches of an autoregressive backbone node: prefill chunks and decode steps mixed.

Per stream it keeps the token sequence the KV cache must hold and how much of it is
computed. A call appends its input tokens; the call is done once every token is
computed, and then the last position's logits are sampled:

    token_ids:     [ p0 p1 p2 p3 p4 p5 | t0 ]      prompt, then fed-back samples
    num_computed:   ------ 4 ------>               (chunked prefill in progress)
    pending work:                 2 + 1 tokens

Preemption drops the pages and sets num_computed to 0: the next call recomputes the
whole sequence, and the sample is the same because sampling is keyed by
(seed, sample index), not by a stateful generator.

Decode one step ahead (decode graphs): after a decode batch returns its tokens, the next
step of the same rows is launched at once, fed from the tokens still on the device and
sampled on the device exactly as the real step would sample (seeded, so the same ids;
penalties, a model's logits mask and min_tokens see the step's tokens), so the GPU
computes step t+1 while the runtime does the host work of step t. Rows asking for
logprobs turn it off (their values would need a second copy). The next `run` uses it
only if it asks for exactly what was guessed (each row's position and input token);
otherwise it is dropped, and so is every row the runtime no longer asks for (a stopped
stream): nothing computed past a stop ever reaches the runtime. A dropped guess costs
GPU time, never correctness: its KV writes are for positions the real step writes again
with the same values, or for pages already given back, which later owners overwrite
before they read. State a step writes beside the KV cache (recurrent states) goes to
rows committed only when the runtime takes the step (`_commit_states`).

Two steps ahead: when a decode batch is exactly the look-ahead step already on the GPU
(every row as guessed, no prefill beside it), the step after it is launched before the
executor waits for that one's ids, fed from its ids on the device; sampling counts the
one step the host has not seen yet (sample index, frame position, min_tokens; its ids are
set in the repetition penalty's seen mask on the device). So the GPU always has the next
step queued while the host takes the current one's ids, instead of idling through the
host's staging of each launch. Rows with recurrent or cross-attention slots, presence or
frequency penalties, or a logits mask without a candidate table (which read host
histories) stay one step ahead. Pinned staging is used in turns of two (DecodeGraphs,
SamplingGraphs): a step is staged while the one before may still wait for its copies.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from omniwalk.engine.attention import PagedAttention, build_metadata
from omniwalk.engine.cuda_graphs import DecodeGraphs, HostCopy
from omniwalk.engine.host_to_device import to_device
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.engine.sampler import RowSettings, Sampler, SamplerOutput, row_keys
from omniwalk.engine.sampling_graphs import CandidateTable, SamplingGraphs
from omniwalk.engine.seen_tokens import SeenTokens
from omniwalk.kernels.triton_support import triton
from omniwalk.runtime.executor import NodeCall, NodeExecutor

logger = logging.getLogger(__name__)
_STREAM_OF = operator.attrgetter("stream")


class TokenHistory:
    """Prompt then sampled ids in a growing numpy buffer: what penalties look at.

    The sampler gets views of it, so a step costs no per-token Python work however long
    the histories are (rebuilding lists of 256 x 700 ids every step was ~10 ms of host time)."""

    def __init__(self, prompt: list[int]):
        self.prompt_len = len(prompt)
        self.buffer = np.empty(max(64, 2 * len(prompt)), dtype=np.int64)
        self.buffer[: len(prompt)] = prompt
        self.length = len(prompt)

    def append(self, token: int) -> None:
        if self.length == len(self.buffer):
            self.buffer = np.concatenate([self.buffer, np.empty_like(self.buffer)])
        self.buffer[self.length] = token
        self.length += 1

    @property
    def prompt(self) -> np.ndarray:
        return self.buffer[: self.prompt_len]

    @property
    def outputs(self) -> np.ndarray:
        return self.buffer[self.prompt_len : self.length]


@dataclass
class SequenceState:
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    prompt_len: int | None = None
    output_ids: list[int] = field(default_factory=list)   # sampled so far (sample index, logits masks)
    history: TokenHistory | None = None                   # only for requests with penalties
    # the rotary position of the token at cache position p is p + rope_offset (a model
    # whose prompt positions run ahead of its length: Qwen3-Omni after an image)
    rope_offset: int = 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token under the raw model distribution."""

    logprob: float
    top: list[tuple[int, float]]    # (token id, logprob), most likely first


# (logits [num_rows, vocab] float32 to set to -inf in place, the rows' calls, each row's
# sampled ids so far) -> None. A model that may only emit some ids (Orpheus: the audio codes
# of the next frame position) brings one; it runs before the sampler, after min_tokens.
# It may also offer `candidate_table(device) -> CandidateTable` (sets of C ids) and
# `candidate_rows(calls, counts) -> list[int]` (the set each row may sample from now, given
# how many ids it has sampled).
# Then the sampler works on those C columns alone (same samples; rows asking for logprobs
# excepted), and a sampling graph can take the step (the set is a row index, not a mask).
LogitsMask = Callable[[torch.Tensor, list[NodeCall], list[list[int]]], None]


class CausalLMExecutor(NodeExecutor):
    """Node `inputs=("tokens",)`, `outputs=("token", "logprobs")` over a paged KV cache.

    A decoder with more per-stream state subclasses it through hooks that cost the text
    models nothing per row: `_eager_inputs` and `_row_slots` (the model's inputs beyond
    ids, positions and attention: a hybrid model's state rows, Whisper's cross-attention
    slot, bound into eager passes and into the decode graphs), `_commit_states` (the step
    succeeded), `_record_samples` (a call's outputs from its sample; a phase change that
    restarts the sequence), and a `LogitsMask` for what may be sampled."""

    chunkable = True

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, max_batch_size: int = 256,
                 decode_graphs: DecodeGraphs | None = None, logits_mask: LogitsMask | None = None,
                 prefill_graphs: PrefillGraphs | None = None):
        self.model = model
        self.cache = cache
        self.sampler = Sampler()
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self.decode_graphs = decode_graphs
        self.prefill_graphs = prefill_graphs   # small eager passes replayed as graphs
        self.logits_mask = logits_mask
        self.sequences: dict[int, SequenceState] = {}
        self.lookahead: _Lookahead | None = None
        self.seen_tokens: SeenTokens | None = None   # the repetition penalty's ids, on the device
        self.sampling_graphs: SamplingGraphs | None = None   # the decode graphs' sampling, graphed
        self._batch_rows: _BatchRows | None = None   # the last sampled batch's fixed per-row values
        self.lookahead_used = 0     # counters for tests and the bench
        self.lookahead_dropped = 0
        self.lookahead_early = 0    # look-ahead steps launched two steps ahead

    # ------------------------------------------------------------ runtime contract

    def begin(self, stream, inputs) -> None:
        tokens = inputs["tokens"]
        sequence = self.sequences.get(stream.handle)
        if sequence is None:
            sequence = self.sequences[stream.handle] = SequenceState()
        if isinstance(tokens, int):        # a decode step: the token sampled last
            sequence.token_ids.append(tokens)
            return
        if not tokens:
            raise ValueError("a call with no tokens")
        if sequence.prompt_len is None:
            sequence.prompt_len = len(tokens)
            sampling = stream.params.sampling
            if sampling is not None and sampling.has_penalties:
                sequence.history = TokenHistory(tokens)
        sequence.token_ids.extend(tokens)
        if sequence.num_computed == 0:   # shared prompt prefixes are computed once
            sequence.num_computed = self.cache.match_prefix(stream.handle, self._prefix_match_key(sequence))

    def pending_work(self, stream) -> int:
        sequence = self.sequences[stream.handle]
        return len(sequence.token_ids) - sequence.num_computed

    def can_reserve(self, stream, num_tokens: int) -> bool:
        return self.cache.can_reserve(stream.handle, self.sequences[stream.handle].num_computed + num_tokens)

    def reserve(self, stream, num_tokens: int) -> None:
        self.cache.reserve(stream.handle, self.sequences[stream.handle].num_computed + num_tokens)

    def holds_state(self, stream) -> bool:
        return bool(self.cache.page_tables.get(stream.handle))

    def preempt(self, stream) -> None:
        self.cache.free(stream.handle)
        self.sequences[stream.handle].num_computed = 0   # recomputed from scratch when it runs again

    def release(self, stream) -> None:
        self.cache.free(stream.handle)
        self.sequences.pop(stream.handle, None)
        if self.seen_tokens is not None:
            self.seen_tokens.free(stream.handle)

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict | None]:
        sequences = [self.sequences[call.stream.handle] for call in calls]
        # Only calls whose last token is computed now produce a sample.
        done = [i for i, (call, s) in enumerate(zip(calls, sequences))
                if s.num_computed + call.num_tokens == len(s.token_ids)]
        # Decode rows replay a decode graph (or take the look-ahead step already computed
        # for them); prefill pieces run eagerly beside them, so a new request joining the
        # batch does not turn the whole step eager.
        decode = self._graph_rows(calls, done)
        in_graph = set(decode)
        eager = [i for i in range(len(calls)) if i not in in_graph]
        # each decode row's row in the look-ahead step on the GPU, if every one is as guessed
        lookahead = self.lookahead
        guessed_rows = (lookahead.rows_for([calls[i] for i in decode], [sequences[i] for i in decode])
                        if lookahead is not None and decode else None)
        # the step after this one, launched now if this one is the look-ahead step on the GPU
        early = self._launch_early(calls, sequences, guessed_rows) if len(decode) == len(calls) else None
        next_rows, sampled, device_tokens = self._forward_and_sample(calls, sequences, done, decode, eager,
                                                                     guessed_rows)

        # Commit only after everything succeeded: a failed batch is retried call by call.
        self._commit_states([call.stream.handle for call in calls])
        size = self.cache.page_size
        for call, sequence in zip(calls, sequences):
            before = sequence.num_computed
            sequence.num_computed = before + call.num_tokens
            if sequence.num_computed // size > before // size:   # a page filled (a decode row: 1 step in 16)
                self.cache.register_full_pages(call.stream.handle, self._prefix_key(sequence), sequence.num_computed)
        # a step launched early already set these tokens in the repetition penalty's mask
        # (`SeenTokens.mark`): queueing them again would write the same bits
        seen_tokens = self.seen_tokens if early is None else None
        results, ended = self._record_samples(calls, sequences, next_rows, sampled, seen_tokens)
        if early is not None:
            early.input_tokens = [token for token, _ in sampled]
            self.lookahead = early
            return results

        if ended:   # no look-ahead step for the calls whose sample ended their sequence
            keep = [k for k, index in enumerate(next_rows) if index not in ended]
            next_rows, sampled = [next_rows[k] for k in keep], [sampled[k] for k in keep]
            if keep:
                device_tokens = device_tokens.index_select(0, to_device(keep, torch.long, device_tokens.device))
        rows, row_sequences = [calls[i] for i in next_rows], [sequences[i] for i in next_rows]
        extra_pages = self._lookahead_pages(rows, row_sequences) if self.decode_graphs is not None and rows else None
        if extra_pages is not None:
            try:
                self.lookahead = self._launch_lookahead(rows, row_sequences, [t for t, _ in sampled], device_tokens,
                                                        extra_pages)
            except Exception:   # the step itself is committed: lose only the guess
                logger.exception("look-ahead step failed; continuing without it")
        return results

    def _forward_and_sample(self, calls, sequences, done: list[int], decode: list[int], eager: list[int],
                            guessed_rows: list[int] | None):
        """The step's samples: (rows that sampled, in the order of the samples: the decode
        rows then the eager ones; (token, logprobs) per row; the ids on the device)."""
        in_graph = set(decode)
        eager_done = [i for i in done if i not in in_graph]
        eager_samples = set(eager_done)
        lookahead, self.lookahead = self.lookahead, None
        guessed = lookahead.take(guessed_rows) if guessed_rows is not None else None
        if lookahead is not None:
            if guessed is not None:
                self.lookahead_used += 1
            else:   # its staging is not written again before the step after this one
                self.lookahead_dropped += 1
        to_sample, logits = (eager_done, []) if guessed is not None else (decode + eager_done, [])
        if decode and guessed is None:
            logits.append(self._decode_with_graph([calls[i] for i in decode], [sequences[i] for i in decode]))
        if eager:
            local_done = [k for k, i in enumerate(eager) if i in eager_samples]
            eager_logits = self._forward_eager([calls[i] for i in eager], [sequences[i] for i in eager], local_done)
            if local_done:
                logits.append(eager_logits)
        sampled, device_tokens = ([], None) if not to_sample else self._sample(
            [calls[i] for i in to_sample], logits[0] if len(logits) == 1 else torch.cat(logits),
            from_decode_graph=not eager_done)
        if guessed is not None:
            sampled = [(token, None) for token in guessed[0]] + sampled
            device_tokens = guessed[1] if device_tokens is None else torch.cat([guessed[1], device_tokens])
        return decode + eager_done, sampled, device_tokens

    def _graph_rows(self, calls: list[NodeCall], done: list[int]) -> list[int]:
        """The calls a decode graph computes: the one-token calls that sample, if they fit."""
        if self.decode_graphs is None:
            return []
        decode = [i for i in done if calls[i].num_tokens == 1]
        if not decode or not self.decode_graphs.fits(
                len(decode), max(len(self.cache.page_tables[calls[i].stream.handle]) for i in decode)):
            return []
        return decode

    def _record_samples(self, calls: list[NodeCall], sequences: list[SequenceState], rows: list[int],
                        sampled: list[tuple[int, "TokenLogprobs | None"]], seen_tokens: SeenTokens | None):
        """Each call's outputs (None: its call goes on), once the step is committed: the
        calls `rows` sampled `sampled` ((token, logprobs), in order), which their sequences
        take. Also returns the calls whose sample ends their sequence (none here): no
        look-ahead step is launched for them.

        Hook: a subclass may add outputs, or end a call without any and restart its
        sequence from a new prompt (a phase change: Whisper's window boundary; see
        `omniwalk.models.whisper.executors`). It changes nothing on the device here: the
        new sequence's KV pages come through `can_reserve` / `reserve` in a later step."""
        results: list[dict | None] = [None] * len(calls)
        for index, (token, logprobs) in zip(rows, sampled):
            sequence = sequences[index]
            sequence.output_ids.append(token)
            if sequence.history is not None:
                sequence.history.append(token)
                if seen_tokens is not None:
                    seen_tokens.append(calls[index].stream.handle, token)
            results[index] = {"token": token, "logprobs": logprobs}
        return results, ()

    def _commit_states(self, handles: list[int]) -> None:
        """Hook: the step computed these streams' tokens and succeeded (hybrid models:
        the state rows it wrote become the committed ones)."""

    def _prefix_key(self, sequence: SequenceState) -> list[int]:
        """Hook: what the prefix cache keys a sequence's pages by (its ids, unless ids alone
        do not determine the KV: media placeholders, keyed by their content instead)."""
        return sequence.token_ids

    def _prefix_match_key(self, sequence: SequenceState) -> list[int]:
        """Hook: the keys a new sequence's prompt looks up cached pages by (`_prefix_key`;
        a shorter list takes no hit past its end: a prefill that must compute some rows)."""
        return self._prefix_key(sequence)

    def _eager_inputs(self, handles: list[int], query_lens: list[int]) -> tuple:
        """Hook: the model's inputs beyond ids, positions and attention in an eager pass
        (hybrid models: the rows' recurrent states)."""
        return ()

    def _graphable(self, handles: list[int]) -> bool:
        """Hook: whether an eager pass over these rows may replay a prefill graph (whose
        inputs are ids, positions and the rows' slots alone); False where a row needs
        inputs of its own (media embeddings, multimodal positions)."""
        return True

    def _row_slots(self, handles: list[int]) -> list[tuple[int, ...]] | None:
        """Hook: each row's slots in the graphs' slot resource (hybrid models: its state rows)."""
        return None

    #: whether a row's slots stay the same from step to step (Whisper's cross-attention
    #: slot, for a window); a hybrid model's state rows alternate, so a step launched two
    #: ahead (`_launch_early`) would need rows not yet committed
    row_slots_fixed = False

    def _lookahead_pages(self, calls, sequences, unseen: int = 0) -> list[int] | None:
        """The pages each row needs for one more token (`unseen`: beyond the ones the host
        has not seen yet), if the batch may look ahead: its next samples come back as ids
        alone (no logprobs to copy) and the pages are free."""
        if self._rows_of(calls).settings.want_logprobs:
            return None
        cache = self.cache
        needed = [cache.pages_needed(c.stream.handle, s.num_computed + 1 + unseen) for c, s in zip(calls, sequences)]
        pages = max(len(cache.page_tables[c.stream.handle]) for c in calls) + 1
        if sum(needed) <= cache.allocator.num_free and self.decode_graphs.fits(len(calls), pages):
            return needed
        return None

    def _launch_early(self, calls, sequences, guessed_rows: list[int] | None) -> "_Lookahead | None":
        """The step after this one, launched before this one's ids reach the host (see the
        module docstring: two steps ahead), if this batch is exactly the look-ahead step
        on the GPU (`guessed_rows`: its rows, in order) and nothing it needs is on the host alone."""
        lookahead = self.lookahead
        if lookahead is None or guessed_rows != list(range(len(lookahead.handles))):
            return None
        rows = self._rows_of(calls)
        mask = self.logits_mask
        if (rows.settings.out_rows or (mask is not None and not hasattr(mask, "candidate_table"))
                or (not self.row_slots_fixed and self._row_slots(rows.handles) is not None)):
            return None
        extra_pages = self._lookahead_pages(calls, sequences, unseen=1)
        if extra_pages is None:
            return None
        try:
            early = self._launch_lookahead(calls, sequences, None, lookahead.device_tokens, extra_pages, unseen=1)
        except Exception:   # nothing is committed yet: the step goes on one step ahead
            logger.exception("early look-ahead step failed; continuing one step ahead")
            return None
        self.lookahead_early += 1
        return early

    def _launch_lookahead(self, calls, sequences, tokens: list[int] | None, device_tokens: torch.Tensor,
                          extra_pages: list[int], unseen: int = 0) -> "_Lookahead":
        """The decode step after the last one of these rows, fed from `device_tokens`.
        `unseen`: 1 if that last step's ids are not on the host yet (its tokens and their
        sampled-so-far counts are one short; `tokens` is then None, filled in later)."""
        handles = [call.stream.handle for call in calls]
        positions = [s.num_computed + unseen for s in sequences]
        for handle, position, extra in zip(handles, positions, extra_pages):
            if extra:   # most steps no row starts a page
                self.cache.reserve(handle, position + 1)
        size = self.cache.page_size
        tables = [self.cache.page_tables[h] for h in handles]
        logits = self.decode_graphs.run(
            input_ids=device_tokens, positions=[p + s.rope_offset for p, s in zip(positions, sequences)],
            slots=[table[p // size] * size + p % size for table, p in zip(tables, positions)],
            context_lens=positions, page_tables=tables, row_slots=self._row_slots(handles),
        )
        # Sampled as the real step would sample it: the histories, the sample indices and
        # the logits mask already count this step's tokens (but for the `unseen` ones, which
        # the sampling adds); the runtime's item counts (min_tokens) do not yet, hence
        # `ahead=1` (+ unseen).
        guessed = self._sample_on_device(calls, logits, ahead=1 + unseen, from_decode_graph=True,
                                         unseen_tokens=device_tokens if unseen else None).token_ids
        return _Lookahead(handles, positions, tokens, guessed, self.decode_graphs.copy_to_host(guessed))

    def _forward_eager(self, calls, sequences, done) -> torch.Tensor:
        input_ids, positions = [], []
        for call, sequence in zip(calls, sequences):
            start, rope_start = sequence.num_computed, sequence.num_computed + sequence.rope_offset
            input_ids.extend(sequence.token_ids[start : start + call.num_tokens])
            positions.extend(range(rope_start, rope_start + call.num_tokens))
        handles, query_lens = [call.stream.handle for call in calls], [call.num_tokens for call in calls]
        context_lens = [s.num_computed for s in sequences]
        tables = [self.cache.page_tables[h] for h in handles]
        if (self.prefill_graphs is not None and self.prefill_graphs.bucket_for(query_lens, [len(t) for t in tables])
                and self._graphable(handles)):
            kv_slots = [slot for h, c, n in zip(handles, context_lens, query_lens) for slot in self.cache.slots(h, c, c + n)]
            logits = self.prefill_graphs.run(input_ids, positions, kv_slots, context_lens, query_lens, tables,
                                             row_slots=self._row_slots(handles))
            return logits if len(done) == len(calls) else logits[to_device(done, torch.long, self.device)]
        metadata = build_metadata(self.cache, handles, context_lens, query_lens, self.device)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True),
            PagedAttention(self.cache, metadata),
            *self._eager_inputs(handles, query_lens),
        )  # [num_tokens, hidden]
        ends = torch.tensor(query_lens).cumsum(0) - 1
        return self.model.compute_logits(hidden[ends[done].to(self.device)])   # [num_done, vocab] fp32

    def _decode_with_graph(self, calls, sequences) -> torch.Tensor:
        handles = [call.stream.handle for call in calls]
        positions = [s.num_computed for s in sequences]
        size = self.cache.page_size
        tables = [self.cache.page_tables[h] for h in handles]
        return self.decode_graphs.run(
            input_ids=[s.token_ids[-1] for s in sequences],
            positions=[p + s.rope_offset for p, s in zip(positions, sequences)],
            slots=[table[p // size] * size + p % size for table, p in zip(tables, positions)],
            context_lens=positions,
            page_tables=tables,
            row_slots=self._row_slots(handles),
        )

    def _sample(self, calls: list[NodeCall], logits: torch.Tensor, from_decode_graph: bool = False):
        """(token, logprobs) per call, and the sampled ids still on the device."""
        out = self._sample_on_device(calls, logits, from_decode_graph=from_decode_graph)
        token_ids = out.token_ids.tolist()   # the one device-to-host copy of the step (a sync)
        chosen = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        results = []
        for row, call in enumerate(calls):
            k, info = call.stream.params.sampling.logprobs, None
            if k is not None and chosen is not None:
                top = list(zip(top_ids[row][:k], top_values[row][:k])) if top_ids is not None else []
                info = TokenLogprobs(chosen[row], top)
            results.append((token_ids[row], info))
        return results, out.token_ids

    def _sample_on_device(self, calls: list[NodeCall], logits: torch.Tensor, ahead: int = 0,
                          from_decode_graph: bool = False, unseen_tokens: torch.Tensor | None = None) -> SamplerOutput:
        """The sampler's output for each call's next item, nothing copied to the host
        (`from_decode_graph`: the logits are the decode graph's output, which a sampling
        graph may sample).

        `ahead`: items the runtime has not counted yet (1 for a look-ahead step).
        `unseen_tokens`: each row's last sample, still on the device only (a step launched
        two ahead): counted as sampled, and seen by the repetition penalty."""
        unseen = 0 if unseen_tokens is None else 1
        # logits: [num_rows, columns] float32; column j scores id first + j (a model may
        # narrow its LM head to the ids it samples: CausalLM.logit_ids)
        rows = self._rows_of(calls)
        settings = rows.settings
        first, columns, vocab = 0, logits.shape[1], logits.shape[1]
        if (logit_ids := getattr(self.model, "logit_ids", None)) is not None:
            first, vocab = logit_ids.start, self.model.config.vocab_size
        # no stop item before min_tokens (as HF/vLLM)
        under_min = [row for row, stream in enumerate(rows.streams)
                     if stream.count + ahead < stream.params.stop.min_items] if rows.any_min_items else []
        mask = self.logits_mask
        table = table_rows = None
        if mask is not None and hasattr(mask, "candidate_table") and not settings.want_logprobs:
            # sample over the allowed columns only: the same ids, a fraction of the work
            table = mask.candidate_table(logits.device)
            table = CandidateTable(table.ids, table.allowed, first)
            table_rows = mask.candidate_rows(calls, [len(ids) + unseen for ids in rows.outputs])
        seen = seen_rows = None
        if settings.rep_rows:
            if self.seen_tokens is None:
                # a row per stream of a full batch: a sampling graph reads the mask where it
                # was when captured, so growing it means capturing again
                self.seen_tokens = SeenTokens(vocab, logits.device, capacity=self.max_batch_size)
            seen_rows = self.seen_tokens.rows(rows.handles, rows.histories)   # first: it may grow the mask
            seen = self.seen_tokens.mask
            if unseen_tokens is not None:
                self.seen_tokens.mark(seen_rows, unseen_tokens)
        sample_indices = [len(ids) + unseen for ids in rows.outputs]
        sampling_graphs = self._sampling_graphs() if from_decode_graph else None
        if (sampling_graphs is not None and not under_min and not settings.want_logprobs and not settings.out_rows
                and (mask is None or table is not None)):
            ids = sampling_graphs.sample(logits, settings, row_keys(rows.seeds, sample_indices),
                                         table, table_rows, seen, seen_rows)
            if ids is not None:
                return SamplerOutput(ids, None, None, None)

        if unseen and (mask is not None and table is None or rows.settings.out_rows):
            raise ValueError("a step two ahead needs a candidate table and no presence/frequency penalties")
        for row in under_min:
            stop = rows.streams[row].params.stop
            banned = [t - first for t in stop.stopping_ids() if first <= t < first + columns]
            logits[row].index_fill_(0, to_device(banned, torch.long, logits.device), float("-inf"))
        candidates = None
        if table is not None:
            logits, candidates = table.columns_of(logits, to_device(table_rows, torch.long, logits.device))
        elif mask is not None and columns == vocab:   # the model's rule for what may be sampled at all
            mask(logits, calls, rows.outputs)
        if columns != vocab and candidates is None:
            raise ValueError(f"this model scores ids [{first}, {first + columns}) only: "
                             f"no logprobs over its {vocab}-id vocabulary")
        if rows.settings.out_rows:   # presence / frequency penalties count the output ids
            empty = np.empty(0, dtype=np.int64)
            prompts = [h.prompt if h is not None else empty for h in rows.histories]
            outputs = [h.outputs if h is not None else empty for h in rows.histories]
        else:   # nothing reads the histories: the seen-id mask serves the repetition penalty
            prompts = outputs = rows.no_histories
        return self.sampler(
            logits, rows.params, seeds=rows.seeds, sample_indices=sample_indices,
            prompt_token_ids=prompts, output_token_ids=outputs, candidate_ids=candidates, vocab_size=vocab,
            seen=seen.index_select(0, seen_rows) if seen is not None else None,
        )

    def _sampling_graphs(self) -> SamplingGraphs | None:
        """The sampling graphs of the current decode graphs (made on first use)."""
        graphs = self.decode_graphs
        if graphs is None or (graphs.on_cuda and triton is None):   # the graphed race is a Triton kernel
            return None
        if self.sampling_graphs is None or self.sampling_graphs.decode_graphs is not graphs:
            self.sampling_graphs = SamplingGraphs(graphs)
        return self.sampling_graphs

    def _sampling_params(self, call: NodeCall):
        """Hook: the sampling parameters of a call's row (the stream's; Whisper's temperature
        fallback decodes a window again at another temperature). A subclass that changes them
        for a stream drops `_batch_rows`, which holds them while the batch keeps its rows."""
        return call.stream.params.sampling

    def _rows_of(self, calls: list[NodeCall]) -> "_BatchRows":
        rows = self._batch_rows
        if rows is not None and rows.calls is calls:   # asked again within one step
            return rows
        if rows is None or not rows.matches(calls):
            params = [self._sampling_params(call) for call in calls]
            rows = self._batch_rows = _BatchRows(calls, [self.sequences[call.stream.handle] for call in calls],
                                                 self.sampler.rows_for(params, self.device))
        rows.calls = calls
        return rows


class _BatchRows:
    """What sampling reads of a batch's streams that stays put while the batch keeps its
    rows (a decode batch, for many steps): gathered once, not per step (~1 ms of host time
    a step at 256 rows)."""

    def __init__(self, calls: list[NodeCall], sequences: list[SequenceState], settings: RowSettings):
        self.calls = calls   # the batch it was last matched with
        self.streams = [call.stream for call in calls]
        self.handles = [stream.handle for stream in self.streams]
        self.params = settings.params
        self.seeds = [stream.params.seed for stream in self.streams]
        self.outputs = [sequence.output_ids for sequence in sequences]      # lists that grow in place
        self.histories = [sequence.history for sequence in sequences]
        self.any_min_items = any(stream.params.stop.min_items > 0 for stream in self.streams)
        self.settings = settings   # the sampler's view of the same rows (logprobs, penalties)
        self.no_histories = [np.empty(0, dtype=np.int64)] * len(calls)

    def matches(self, calls: list[NodeCall]) -> bool:
        # StreamState compares by identity: one C-level list comparison
        return len(calls) == len(self.streams) and list(map(_STREAM_OF, calls)) == self.streams


@dataclass
class _Lookahead:
    """A decode step launched before the runtime asked for it (see the module docstring)."""

    handles: list[int]           # rows, in launch order
    positions: list[int]         # the position each row computed
    input_tokens: list[int] | None   # the token each row was fed (None until the host has them)
    device_tokens: torch.Tensor  # [rows] the greedy samples, on the device
    host_copy: "HostCopy"

    def rows_for(self, calls, sequences) -> list[int] | None:
        """Each call's row of this step, if every call is exactly what was guessed."""
        row_of = {handle: row for row, handle in enumerate(self.handles)}
        rows = []
        for call, sequence in zip(calls, sequences):
            row = row_of.get(call.stream.handle)
            if (row is None or call.num_tokens != 1 or sequence.num_computed != self.positions[row]
                    or len(sequence.token_ids) != self.positions[row] + 1
                    or sequence.token_ids[-1] != self.input_tokens[row]):
                return None
            rows.append(row)
        return rows

    def take(self, rows: list[int]) -> tuple[list[int], torch.Tensor]:
        """The guessed samples of these rows (`rows_for`), on the host and on the device."""
        host = self.host_copy.wait()
        if rows == list(range(len(self.handles))):
            return host, self.device_tokens
        index = to_device(rows, torch.long, self.device_tokens.device)
        return [host[row] for row in rows], self.device_tokens.index_select(0, index)
