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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from omniwalk.engine.attention import PagedAttention, build_metadata
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.sampler import Sampler
from omniwalk.runtime.executor import NodeCall, NodeExecutor


@dataclass
class SequenceState:
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    prompt_len: int | None = None
    output_ids: list[int] = field(default_factory=list)   # sampled so far (penalties, sample index)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token under the raw model distribution."""

    logprob: float
    top: list[tuple[int, float]]    # (token id, logprob), most likely first


# (logits [num_rows, vocab] float32 to set to -inf in place, the rows' calls, each row's
# sampled ids so far) -> None. A model that may only emit some ids (Orpheus: the audio codes
# of the next frame position) brings one; it runs before the sampler, after min_tokens.
LogitsMask = Callable[[torch.Tensor, list[NodeCall], list[list[int]]], None]


class CausalLMExecutor(NodeExecutor):
    """Node `inputs=("tokens",)`, `outputs=("token", "logprobs")` over a paged KV cache."""

    chunkable = True

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, max_batch_size: int = 256,
                 decode_graphs: DecodeGraphs | None = None, logits_mask: LogitsMask | None = None):
        self.model = model
        self.cache = cache
        self.sampler = Sampler()
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self.decode_graphs = decode_graphs
        self.logits_mask = logits_mask
        self.sequences: dict[int, SequenceState] = {}

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
        sequence.token_ids.extend(tokens)
        if sequence.num_computed == 0:   # shared prompt prefixes are computed once
            sequence.num_computed = self.cache.match_prefix(stream.handle, sequence.token_ids)

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

    # ------------------------------------------------------------ the step

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict | None]:
        sequences = [self.sequences[call.stream.handle] for call in calls]
        # Only calls whose last token is computed now produce a sample.
        done = [i for i, (call, s) in enumerate(zip(calls, sequences))
                if s.num_computed + call.num_tokens == len(s.token_ids)]
        is_decode = len(done) == len(calls) and all(call.num_tokens == 1 for call in calls)
        if is_decode and self.decode_graphs is not None and self.decode_graphs.fits(
                len(calls), max(len(self.cache.page_tables[c.stream.handle]) for c in calls)):
            logits = self._decode_with_graph(calls, sequences)
        else:
            logits = self._forward_eager(calls, sequences, done)
        samples = self._sample([calls[i] for i in done], logits) if done else []

        # Commit only after everything succeeded: a failed batch is retried call by call.
        for call, sequence in zip(calls, sequences):
            sequence.num_computed += call.num_tokens
            self.cache.register_full_pages(call.stream.handle, sequence.token_ids, sequence.num_computed)
        results: list[dict | None] = [None] * len(calls)
        for index, (token, logprobs) in zip(done, samples):
            self.sequences[calls[index].stream.handle].output_ids.append(token)
            results[index] = {"token": token, "logprobs": logprobs}
        return results

    def _forward_eager(self, calls, sequences, done) -> torch.Tensor:
        input_ids, positions = [], []
        for call, sequence in zip(calls, sequences):
            start = sequence.num_computed
            input_ids.extend(sequence.token_ids[start : start + call.num_tokens])
            positions.extend(range(start, start + call.num_tokens))
        metadata = build_metadata(
            self.cache, [call.stream.handle for call in calls],
            [s.num_computed for s in sequences], [call.num_tokens for call in calls], self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True),
            PagedAttention(self.cache, metadata),
        )  # [num_tokens, hidden]
        ends = torch.tensor([call.num_tokens for call in calls]).cumsum(0) - 1
        return self.model.compute_logits(hidden[ends[done].to(self.device)])   # [num_done, vocab] fp32

    def _decode_with_graph(self, calls, sequences) -> torch.Tensor:
        handles = [call.stream.handle for call in calls]
        positions = [s.num_computed for s in sequences]
        size = self.cache.page_size
        tables = [self.cache.page_tables[h] for h in handles]
        return self.decode_graphs.run(
            input_ids=[s.token_ids[-1] for s in sequences],
            positions=positions,
            slots=[table[p // size] * size + p % size for table, p in zip(tables, positions)],
            context_lens=positions,
            page_tables=tables,
        )

    def _sample(self, calls: list[NodeCall], logits: torch.Tensor) -> list[tuple[int, TokenLogprobs | None]]:
        # logits: [num_done, vocab] float32
        sequences = [self.sequences[call.stream.handle] for call in calls]
        for row, call in enumerate(calls):
            stop = call.stream.params.stop
            if call.stream.count < stop.min_items:   # no stop item before min_tokens (as HF/vLLM)
                banned = [t for t in stop.stopping_ids() if t < logits.shape[1]]
                logits[row, banned] = float("-inf")
        if self.logits_mask is not None:   # the model's rule for what may be sampled at all
            self.logits_mask(logits, calls, [s.output_ids for s in sequences])
        params = [call.stream.params.sampling for call in calls]
        # token histories only matter to penalties: skip copying prompts otherwise
        penalized = any(p.has_penalties for p in params)
        out = self.sampler(
            logits, params,
            seeds=[call.stream.params.seed for call in calls],
            sample_indices=[len(s.output_ids) for s in sequences],
            prompt_token_ids=[s.token_ids[: s.prompt_len] if penalized else [] for s in sequences],
            output_token_ids=[s.output_ids for s in sequences],
        )
        token_ids = out.token_ids.tolist()   # the one device-to-host copy of the step
        chosen = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_values = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        results = []
        for row, param in enumerate(params):
            info = None
            if param.logprobs is not None and chosen is not None:
                k = param.logprobs
                top = list(zip(top_ids[row][:k], top_values[row][:k])) if top_ids is not None else []
                info = TokenLogprobs(chosen[row], top)
            results.append((token_ids[row], info))
        return results
