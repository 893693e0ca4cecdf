"""Runs a hybrid decoder (attention layers + recurrent layers, e.g. Qwen3.5) as a node.

Everything of `CausalLMExecutor` holds (chunked prefill, decode steps, sampling); each
stream additionally holds one slot of a `StatePool` beside its KV pages:

    resource     attention layers          recurrent layers (Gated DeltaNet)
    -----------  ------------------------  ------------------------------------
    size         grows: a page per         fixed: one slot (conv + recurrent
                 page_size tokens          state per layer)
    taken        reserve()                 reserve(), the first time it runs
    freed        release / preempt         release / preempt
    a retry      rewrites the same slots   reads the committed state again

Chunked prefill carries the state from chunk to chunk through the slot. Preemption frees
the pages and the slot and recomputes from token 0, from an empty state. Prefix caching
stays off for hybrid models (see `omniwalk.engine.state_pool`): the cache must have it off.

A forward pass (eager, or a decode or prefill graph's replay) reads each stream's
committed state row and writes its new state to the slot's other row (`StatePool.rows`);
the written rows become the committed ones only once the whole step (forward and
sampling) succeeded (`StatePool.commit`), so a failed batch leaves every stream's state as
it was, as the `NodeExecutor` contract asks. A look-ahead step (see `CausalLMExecutor`)
is committed by the step that takes it, and only for the streams that step computes: a
dropped guess, or a row of a stream that stopped, never becomes a committed state.
"""

from __future__ import annotations

import torch

from omniwalk.engine.causal_lm_executor import CausalLMExecutor
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.engine.state_pool import StateBatch, StatePool


class HybridLMExecutor(CausalLMExecutor):
    """`CausalLMExecutor` for a model called as `model(input_ids, positions, attention, states)`."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, state_pool: StatePool,
                 max_batch_size: int = 256, decode_graphs: DecodeGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None):
        if cache.enable_prefix_caching:
            raise ValueError("prefix caching cannot be on for a hybrid model: a shared KV prefix "
                             "comes without the recurrent state at its end")
        if decode_graphs is not None and decode_graphs.slot_resource is not state_pool:
            raise ValueError("the decode graphs must read and write this executor's state pool")
        super().__init__(model, cache, max_batch_size, decode_graphs=decode_graphs, prefill_graphs=prefill_graphs)
        self.state_pool = state_pool

    # ------------------------------------------------------------ resources

    def can_reserve(self, stream, num_tokens: int) -> bool:
        has_slot = self.state_pool.holds(stream.handle) or self.state_pool.can_allocate()
        return has_slot and super().can_reserve(stream, num_tokens)

    def reserve(self, stream, num_tokens: int) -> None:
        super().reserve(stream, num_tokens)
        if not self.state_pool.holds(stream.handle):
            self.state_pool.allocate(stream.handle)

    def holds_state(self, stream) -> bool:
        return super().holds_state(stream) or self.state_pool.holds(stream.handle)

    def preempt(self, stream) -> None:
        super().preempt(stream)
        self.state_pool.free(stream.handle)

    def release(self, stream) -> None:
        super().release(stream)
        self.state_pool.free(stream.handle)

    # ------------------------------------------------------------ the step

    # The base step forwards (`_forward_eager` below, or a decode graph), samples, then
    # commits; if it raises first, the written rows are never committed.

    def _commit_states(self, handles: list[int]) -> None:
        self.state_pool.commit(handles)

    def _row_slots(self, handles: list[int]) -> list[tuple[int, int]]:
        return [self.state_pool.rows(h) for h in handles]

    def _eager_inputs(self, handles: list[int], query_lens: list[int]) -> tuple:
        return (StateBatch(self.state_pool, self._row_slots(handles), query_lens),)
