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

A forward pass reads the slots, computes new states aside (`StateBatch`), and writes them
back only once the whole step (forward and sampling) succeeded, so a failed batch leaves
every stream's state as it was, as the `NodeExecutor` contract asks. A decode step that
replays a CUDA graph leaves its new states in the graph's output tensors until the same
commit point (`DecodeGraphs.commit_states`); of a look-ahead step (see `CausalLMExecutor`)
only the rows the runtime takes are committed (the others write the scratch slot), so a
dropped guess never reaches the pool.
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
        self._commit_eager = None   # writes the eager part's new states (a StateBatch's or a prefill graph's)

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
    # commits; if it raises first, the new states are simply dropped.

    def _commit_states(self, graph_rows: bool, eager_rows: bool) -> None:
        if graph_rows:
            self.decode_graphs.commit_states()
        if eager_rows:
            self._commit_eager()
            self._commit_eager = None

    def _lookahead_taken(self, rows: list[int], num_rows: int) -> None:
        # A stopped stream's row must not commit: its slot may already be another stream's.
        if len(rows) < num_rows:
            self.decode_graphs.commit_rows_only(rows)

    def _row_slots(self, handles: list[int]) -> list[int]:
        return [self.state_pool.slots[h] for h in handles]

    def _prefill_graph_ran(self) -> None:
        self._commit_eager = self.prefill_graphs.commit_states

    def _eager_inputs(self, handles: list[int], query_lens: list[int]) -> tuple:
        states = StateBatch(self.state_pool, [self.state_pool.slots[h] for h in handles], query_lens)
        self._commit_eager = states.commit
        return (states,)
