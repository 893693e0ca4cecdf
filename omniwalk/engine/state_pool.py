"""Recurrent state of linear-attention layers: one fixed-size slot per sequence.

A Gated DeltaNet (or Mamba) layer summarizes a sequence's whole past in a state of fixed
size, unlike attention, whose KV cache grows a page at a time. Per recurrent layer a
slot holds the short-convolution state and the recurrent state:

    conv:       [num_layers, num_slots, conv_dim, conv_kernel - 1]       model dtype
    recurrent:  [num_layers, num_slots, heads, key_dim, value_dim]        fp32

    handle 7 -> slot 2:   conv[:, 2], recurrent[:, 2]   (every recurrent layer)

A slot is taken the first time a sequence runs and given back when it ends or is
preempted; a newly taken slot holds the empty state (zeros), so a preempted sequence
recomputes from scratch, exactly like its dropped KV pages.

The state cannot be rewound: it has absorbed every token. So prefix caching (sharing the
KV pages of a common prompt prefix, `PagedKVCache(enable_prefix_caching=True)`) does not
carry over to hybrid models: skipping the shared prefix would also need the recurrent
state as it stood at that page boundary. Hybrid models keep prefix caching off (their
executor refuses a cache with it on) until the pool can snapshot states at page boundaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from omniwalk.engine.host_to_device import to_device
from omniwalk.layers.ragged import RaggedLengths


@dataclass(frozen=True)
class StatePoolShape:
    num_layers: int         # layers with a recurrent state (not the attention layers)
    conv_dim: int           # channels of the short convolution
    conv_kernel: int        # its taps; the state keeps the last conv_kernel - 1 inputs
    num_heads: int          # recurrent state: [num_heads, key_dim, value_dim]
    key_dim: int
    value_dim: int
    num_slots: int

    def __post_init__(self):
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        for name in ("conv_dim", "conv_kernel", "num_heads", "key_dim", "value_dim", "num_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.tensor([], dtype=dtype).element_size()
        recurrent = self.num_heads * self.key_dim * self.value_dim * 4
        return self.num_layers * (conv + recurrent)


class StatePool:
    """State slots of one node's sequences, keyed by integer handles chosen by the caller.

    Check with `can_allocate`, then `allocate`; `free` at release or preemption.
    """

    def __init__(self, shape: StatePoolShape, dtype: torch.dtype, device: torch.device | str):
        self.shape = shape
        s = shape
        self.conv = torch.zeros((s.num_layers, s.num_slots, s.conv_dim, s.conv_kernel - 1), dtype=dtype, device=device)
        # fp32 whatever the model dtype: the state accumulates over the whole sequence
        self.recurrent = torch.zeros((s.num_layers, s.num_slots, s.num_heads, s.key_dim, s.value_dim),
                                     dtype=torch.float32, device=device)
        self._free = list(range(s.num_slots - 1, -1, -1))   # pop from the end: low slots first
        self.slots: dict[int, int] = {}                     # handle -> slot

    @property
    def num_slots(self) -> int:
        return self.shape.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, handle: int) -> bool:
        return handle in self.slots

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self, handle: int) -> int:
        """A slot holding the empty state for `handle` (which must hold none)."""
        if handle in self.slots:
            raise RuntimeError(f"handle {handle} already holds slot {self.slots[handle]}")
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        self.slots[handle] = slot
        return slot

    def free(self, handle: int) -> None:
        slot = self.slots.pop(handle, None)
        if slot is not None:
            self._free.append(slot)

    # as a decode graph's `SlotResource`: a step writes new states, committed after it
    writes_back = True

    def decode_view(self, slots: torch.Tensor) -> "StateBatch":
        return StateBatch.for_graph(self, slots)

    def prefill_view(self, slots: torch.Tensor, ragged: RaggedLengths) -> "StateBatch":
        return StateBatch.for_graph(self, slots, ragged)

    def commit_view(self, view: "StateBatch") -> None:
        view.commit()


class StateBatch:
    """The recurrent states of one forward pass over a ragged batch.

    Layers read their sequences' states, and hand back new ones; nothing reaches the pool
    until `commit`, so a pass that raises leaves every sequence's state as it was (the
    runtime then retries its calls one by one). Sequence b owns rows [start_b, start_b +
    query_lens[b]) of the flat token dimension (`ragged`: that layout as the recurrent
    layers' kernels take it):

        flat tokens:  [ seq0: 5 prefill tokens | seq1: 1 decode token | seq2: 3 chunk tokens ]
        all_decode:   False        (True: one token per sequence, one batched recurrent step)
    """

    def __init__(self, pool: StatePool, slots: list[int], query_lens: list[int]):
        self.pool = pool
        self.query_lens = list(query_lens)
        # a queued copy: `torch.tensor(..., device="cuda")` would wait for the GPU, which is
        # still running this step's decode graph when a prefill's pass is being launched
        self.slot_index = to_device(slots, torch.long, pool.conv.device)
        self.all_decode = all(n == 1 for n in self.query_lens)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_graph(cls, pool: StatePool, slot_index: torch.Tensor, ragged: RaggedLengths | None = None) -> "StateBatch":
        """A CUDA graph's batch over `slot_index`, a static input buffer: the graph reads
        the slots it holds at replay, and the states it writes stay in the graph's output
        tensors until `commit`. Without `ragged`: a decode batch (one token per sequence);
        with it, a ragged batch whose layout the graph's buffers hold."""
        batch = cls.__new__(cls)
        batch.pool = pool
        batch.query_lens = None
        batch.slot_index = slot_index
        batch.all_decode = ragged is None
        if ragged is not None:
            batch.__dict__["ragged"] = ragged
        batch._pending = {}
        return batch

    @functools.cached_property
    def ragged(self) -> RaggedLengths:
        """The batch's layout as the recurrent kernels take it, built once for all layers."""
        return RaggedLengths(self.query_lens, self.pool.conv.device, self.pool.shape.conv_kernel)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of (conv [B, conv_dim, K-1], recurrent [B, heads, key_dim, value_dim]) of recurrent layer `layer`."""
        return (self.pool.conv[layer].index_select(0, self.slot_index),
                self.pool.recurrent[layer].index_select(0, self.slot_index))

    def write(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The states after this pass (same shapes as `read`); kept aside until `commit`."""
        self._pending[layer] = (conv, recurrent)

    def commit(self) -> None:
        """Write the new states into the pool (in a CUDA graph's batch, whatever slots its
        buffer holds when the commit runs)."""
        for layer, (conv, recurrent) in self._pending.items():
            self.pool.conv[layer].index_copy_(0, self.slot_index, conv.to(self.pool.conv.dtype))
            self.pool.recurrent[layer].index_copy_(0, self.slot_index, recurrent.float())
