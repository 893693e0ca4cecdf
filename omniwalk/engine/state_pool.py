"""Recurrent state of linear-attention layers: one fixed-size slot per sequence.

A Gated DeltaNet (or Mamba) layer summarizes a sequence's whole past in a state of fixed
size, unlike attention, whose KV cache grows a page at a time. Per recurrent layer a
slot holds the short-convolution state and the recurrent state, each twice: the committed
state, and room for the state a running step computes (double buffering):

    conv:       [num_layers, 2 * num_slots, conv_dim, conv_kernel - 1]     model dtype
    recurrent:  [num_layers, 2 * num_slots, heads, key_dim, value_dim]      fp32

    handle 7 -> slot 2 -> rows 4 and 5:   committed in row 4 + parity, the next step's in the other

A step reads each sequence's committed row and writes the other one in place (`StateRows`:
no gathered copies, no copy back); `commit(handles)` after the step succeeded flips the
parity of the sequences it computed, on the host. A step that fails, or a look-ahead step
the runtime drops, is simply never committed: the committed rows were never written.

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

import numpy as np
import torch

from omniwalk.engine.host_to_device import to_device
from omniwalk.engine.ragged import RaggedLengths
from omniwalk.kernels.state_rows import StateRows


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
        """Both rows of a slot (committed and next), every layer."""
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.tensor([], dtype=dtype).element_size()
        recurrent = self.num_heads * self.key_dim * self.value_dim * 4
        return 2 * self.num_layers * (conv + recurrent)


class StatePool:
    """State slots of one node's sequences, keyed by integer handles chosen by the caller.

    Check with `can_allocate`, then `allocate`; `free` at release or preemption. A step
    reads and writes the rows `rows(handle)` names; `commit` once it succeeded.
    """

    slots_per_row = 2   # as a graph's `SlotResource`: a row reads one pool row and writes another

    def __init__(self, shape: StatePoolShape, dtype: torch.dtype, device: torch.device | str):
        self.shape = shape
        s = shape
        rows = 2 * s.num_slots
        self.conv = torch.zeros((s.num_layers, rows, s.conv_dim, s.conv_kernel - 1), dtype=dtype, device=device)
        # fp32 whatever the model dtype: the state accumulates over the whole sequence
        self.recurrent = torch.zeros((s.num_layers, rows, s.num_heads, s.key_dim, s.value_dim),
                                     dtype=torch.float32, device=device)
        self._free = list(range(s.num_slots - 1, -1, -1))   # pop from the end: low slots first
        self.slots: dict[int, int] = {}                     # handle -> slot
        self._parity = [0] * s.num_slots                    # slot -> which of its rows is committed

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
        # Queued after any step still running on the device: a look-ahead step launched for
        # the slot's last owner writes its rows before they are cleared.
        self.conv[:, 2 * slot : 2 * slot + 2].zero_()
        self.recurrent[:, 2 * slot : 2 * slot + 2].zero_()
        self._parity[slot] = 0
        self.slots[handle] = slot
        return slot

    def free(self, handle: int) -> None:
        slot = self.slots.pop(handle, None)
        if slot is not None:
            self._free.append(slot)

    def rows(self, handle: int) -> tuple[int, int]:
        """(the row holding `handle`'s committed state, the row its next step writes)."""
        slot = self.slots[handle]
        committed = 2 * slot + self._parity[slot]
        return committed, committed ^ 1

    def commit(self, handles: list[int]) -> None:
        """The step that just ran for these handles succeeded: their written rows become
        the committed ones."""
        for handle in handles:
            self._parity[self.slots[handle]] ^= 1

    # as a graph's `SlotResource`
    def row_slots(self, handle: int) -> tuple[int, int]:
        return self.rows(handle)

    def decode_view(self, row_slots: torch.Tensor) -> "StateBatch":
        return StateBatch.for_graph(self, row_slots)

    def prefill_view(self, row_slots: torch.Tensor, ragged: RaggedLengths) -> "StateBatch":
        return StateBatch.for_graph(self, row_slots, ragged)


class StateBatch:
    """The recurrent states of one forward pass over a ragged batch: which pool rows each
    sequence reads and writes (`StatePool.rows`), and its tokens. Sequence b owns rows
    [start_b, start_b + query_lens[b]) of the flat token dimension (`ragged`: that layout as
    the recurrent layers' kernels take it):

        flat tokens:  [ seq0: 5 prefill tokens | seq1: 1 decode token | seq2: 3 chunk tokens ]
        all_decode:   False        (True: one token per sequence, one batched recurrent step)
    """

    def __init__(self, pool: StatePool, rows: list[tuple[int, int]], query_lens: list[int]):
        self.pool = pool
        self.query_lens = list(query_lens)
        # one queued copy: `torch.tensor(..., device="cuda")` would wait for the GPU, which
        # is still running this step's decode graph when a prefill's pass is being launched
        self.row_slots = to_device(np.asarray(rows, dtype=np.int64).reshape(-1, 2).T.copy(), torch.long,
                                   pool.conv.device)
        self.all_decode = all(n == 1 for n in self.query_lens)

    @classmethod
    def for_graph(cls, pool: StatePool, row_slots: torch.Tensor, ragged: RaggedLengths | None = None) -> "StateBatch":
        """A CUDA graph's batch over `row_slots` [2, sequences] (read rows; write rows), a
        static input buffer: the graph reads and writes the rows it holds at replay.
        Without `ragged`: a decode batch (one token per sequence); with it, a ragged batch
        whose layout the graph's buffers hold."""
        batch = cls.__new__(cls)
        batch.pool = pool
        batch.query_lens = None
        batch.row_slots = row_slots
        batch.all_decode = ragged is None
        if ragged is not None:
            batch.__dict__["ragged"] = ragged
        return batch

    @functools.cached_property
    def ragged(self) -> RaggedLengths:
        """The batch's layout as the recurrent kernels take it, built once for all layers."""
        return RaggedLengths(self.query_lens, self.pool.conv.device, self.pool.shape.conv_kernel)

    def conv(self, layer: int) -> StateRows:
        """Recurrent layer `layer`'s conv states: rows [conv_dim, kernel - 1]."""
        return StateRows(self.pool.conv[layer], self.row_slots[0], self.row_slots[1])

    def recurrent(self, layer: int) -> StateRows:
        """Recurrent layer `layer`'s recurrent states: rows [heads, key_dim, value_dim] fp32."""
        return StateRows(self.pool.recurrent[layer], self.row_slots[0], self.row_slots[1])
