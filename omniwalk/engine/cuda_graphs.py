"""Decode steps captured as CUDA graphs, one per batch-size bucket.

A decode batch is B sequences with one new token each; with page tables padded to a
fixed width its shapes depend on B alone, so each bucket is captured once and replayed.
A batch of n < B sequences replays bucket B with the extra rows pointed at a scratch
page that no sequence owns:

    rows 0 .. n-1:  real sequences (token, position, slot, context length, page table)
    rows n .. B-1:  token 0, position 0, slot = scratch page, context 0   (results dropped)

The graph covers the model forward and the LM head; sampling runs after it on the
device (most batches: one more replay, `omniwalk.engine.sampling_graphs`), so one step
costs two replays and one copy to the host.

A model with a per-sequence resource of fixed-size slots (`SlotResource`: a hybrid
model's `StatePool`, Whisper's cross-attention cache) also gets each row's slots as an
input buffer (cross-attention: the slot it reads; recurrent state: the row it reads and
the row it writes, committed by the executor once the step succeeded); padded rows use a
scratch slot.

On a CPU nothing is captured: `run` computes the same forward eagerly from the same
buffers, so everything built on decode graphs (the look-ahead step, the state rows)
runs in CI too. It brings no speed there, so CPU engines do not use it by default.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np
import torch

from omniwalk.engine.attention import AttentionMetadata, PagedAttention
from omniwalk.engine.host_to_device import to_device
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.kernels.triton_support import graph_launches

SCRATCH_SLOT_HANDLE = -1   # the handle holding the padded rows' slot


class SlotResource(Protocol):
    """A per-sequence resource of fixed-size slots that a step reads (and may write) by slot."""

    slots_per_row: int   # slot indices per batch row: 1 (read) or 2 (read, write)

    def allocate(self, handle: int) -> int: ...

    def row_slots(self, handle: int) -> tuple[int, ...]:
        """The `slots_per_row` indices of `handle`'s row in the next step."""

    def decode_view(self, row_slots: torch.Tensor) -> Any:
        """The model's extra input for a decode batch whose rows use `row_slots`
        [slots_per_row, batch] (a static buffer: the view reads whatever it holds when
        the graph replays)."""

    # for `PrefillGraphs` (hybrid models' state pool): prefill_view(row_slots, ragged) -> Any,
    # the input of a ragged batch whose layout (`RaggedLengths`) lives in static buffers


def capture_per_bucket(device: torch.device, buckets: list, forward: Callable[[Any], torch.Tensor],
                       warmups: int = 1, prepare: Callable[[Any], None] | None = None, pool=None) -> dict:
    """One CUDA graph of `forward(bucket)` per bucket, largest first, all sharing one memory
    pool (a smaller graph reuses the larger ones' memory; `pool`: an earlier capture's, to
    share it too). `prepare(bucket)` may fill input buffers before a bucket's warm-up.
    Returns bucket -> (graph, its output)."""
    graphs = {}
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), graph_launches():   # the warm-ups too: they compile what the capture launches
        for batch in reversed(buckets):
            if prepare is not None:
                prepare(batch)
            for _ in range(warmups):
                forward(batch)                 # warm up (Triton autotune/compile, cuDNN, allocator)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                output = forward(batch)
            # a graph's first replay also uploads it to the device (cudaGraphUpload's work):
            # done here, not inside a serving step (not measured apart on its own)
            graph.replay()
            pool = graph.pool()
            graphs[batch] = (graph, output)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs


def batch_buckets(max_batch_size: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    buckets += list(range(16, max_batch_size, 16))
    return sorted(set(buckets + [max_batch_size]))


class BucketGraphs:
    """What `DecodeGraphs` and `PrefillGraphs` share: one graph of `_forward(bucket)` per
    bucket, replayed with its inputs in static buffers (on a CPU: the forward run eagerly,
    nothing captured). A subclass sets `device`, `on_cuda`, `buckets` and calls `_init_graphs()`."""

    def _init_graphs(self) -> None:
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, bucket) -> torch.Tensor:
        raise NotImplementedError

    def _capture(self, prepare: Callable[[Any], None] | None = None) -> None:
        if self.on_cuda:
            self.graphs = capture_per_bucket(self.device, self.buckets, self._forward, warmups=2, prepare=prepare)

    def _replay(self, bucket, count: int) -> torch.Tensor:
        """The first `count` rows of the bucket's output, its inputs already in the buffers."""
        if not self.on_cuda:
            return self._forward(bucket)[:count]
        graph, output = self.graphs[bucket]
        graph.replay()
        return output[:count]


class DecodeGraphs(BucketGraphs):
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, max_batch_size: int, max_pages_per_sequence: int,
                 slot_resource: SlotResource | None = None):
        self.model = model
        self.cache = cache
        self.device = cache.keys.device
        self.buckets = batch_buckets(max_batch_size)
        self.max_batch_size = self.buckets[-1]
        self.max_pages = max_pages_per_sequence
        self.scratch_page = cache.allocator.allocate(1)[0]   # owned by no sequence, ever
        size = self.max_batch_size
        on = dict(device=self.device)
        self.input_ids = torch.zeros(size, dtype=torch.long, **on)
        self.positions = torch.zeros(size, dtype=torch.long, **on)
        self.slots = torch.full((size,), self.scratch_page * cache.page_size, dtype=torch.long, **on)
        self.context_lens = torch.zeros(size, dtype=torch.int32, **on)
        self.query_start = torch.arange(size + 1, dtype=torch.int32, **on)
        self.page_table = torch.full((size, self.max_pages), self.scratch_page, dtype=torch.int32, **on)
        self.slot_resource = slot_resource
        self._init_graphs()
        self.slot_columns = slot_resource.slots_per_row if slot_resource is not None else 0
        if slot_resource is not None:
            slot_resource.allocate(SCRATCH_SLOT_HANDLE)   # owned by no sequence, ever
            self.scratch_row_slots = slot_resource.row_slots(SCRATCH_SLOT_HANDLE)
            self.row_slots = torch.tensor(self.scratch_row_slots, dtype=torch.long, **on)[:, None].repeat(1, size)
        self.on_cuda = self.device.type == "cuda"
        pinned = dict(pin_memory=self.on_cuda)
        # Two sets of pinned staging, used in turn: a step is staged while the one before it
        # may still wait on the GPU for its copies (the executor launches a look-ahead step
        # before it waits for the current one); the step two before has been waited for.
        self._staging = [_Staging(torch.zeros(3 + self.slot_columns, size, dtype=torch.long, **pinned),
                                  torch.zeros(size, 1 + self.max_pages, dtype=torch.int32, **pinned))
                         for _ in range(2)]
        self._next_staging = 0
        # two pinned buffers for look-ahead copies: one in flight while the other is read
        self._copy_slots = [torch.zeros(size, dtype=torch.long, **pinned) for _ in range(2)]
        self._next_copy_slot = 0

    def _attention(self, batch: int) -> PagedAttention:
        """The step's attention over the static buffers' first `batch` rows."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:batch], query_start=self.query_start[: batch + 1],
            context_lens_tensor=self.context_lens[:batch], page_table_tensor=self.page_table[:batch],
            max_query_len=1,
        )
        return PagedAttention(self.cache, meta)

    def _forward(self, batch: int) -> torch.Tensor:
        inputs = (self.input_ids[:batch], self.positions[:batch], self._attention(batch))
        if self.slot_resource is not None:
            inputs += (self.slot_resource.decode_view(self.row_slots[:, :batch]),)
        hidden = self.model(*inputs)
        return self.model.compute_logits(hidden)   # [batch, vocab] fp32

    @torch.inference_mode()
    def capture(self) -> None:
        self._capture()

    def bucket_for(self, rows: int) -> int:
        """The batch size whose graph a step of `rows` sequences replays."""
        return next(b for b in self.buckets if b >= rows)

    def fits(self, batch: int, max_pages: int) -> bool:
        return batch <= self.max_batch_size and max_pages <= self.max_pages

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            context_lens: list[int], page_tables: list[list[int]],
            row_slots: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n sequences.

        `input_ids` may be a device tensor (the previous step's samples): then the step
        is launched without the host ever seeing the tokens. `row_slots`: each row's
        slots in the slot resource (if any: `SlotResource.row_slots`)."""
        n = len(positions)
        batch = self.bucket_for(n)
        staging = self._staging[self._next_staging]
        self._next_staging ^= 1
        host_longs, host_ints = staging.longs, staging.ints
        longs = host_longs.numpy()
        on_device = isinstance(input_ids, torch.Tensor)
        if not on_device:
            longs[0, :n] = input_ids
        longs[1, :n], longs[2, :n] = positions, slots
        longs[0, n:batch] = 0
        longs[1, n:batch] = 0
        longs[2, n:batch] = self.scratch_page * self.cache.page_size
        width = max(len(table) for table in page_tables)
        ints = host_ints.numpy()
        ints[:n, 0] = context_lens
        ints[n:batch, 0] = 0
        # A row's table changes only when it gains a page (every page_size steps) or the
        # batch changes: rewrite only those rows (the lists are the cache's own, which
        # only grow while their sequence holds them; holding the last ones keeps their
        # identities from being reused).
        last_tables, last_lengths, lengths = staging.written_tables, staging.written_lengths, []
        for row, table in enumerate(page_tables):
            length = len(table)
            lengths.append(length)
            if row >= len(last_tables) or last_tables[row] is not table or last_lengths[row] != length:
                ints[row, 1 : 1 + length] = table
        staging.written_tables, staging.written_lengths = page_tables, lengths
        ints[n:batch, 1] = self.scratch_page
        if self.slot_resource is not None:
            longs[3:, :n] = np.asarray(row_slots, dtype=np.int64).reshape(n, -1).T
            longs[3:, n:batch] = np.asarray(self.scratch_row_slots, dtype=np.int64)[:, None]
            # all columns (a few KiB): one contiguous copy; the bucket reads its first `batch`
            self.row_slots.copy_(host_longs[3:], non_blocking=True)
        if on_device:
            self.input_ids[:n].copy_(input_ids)
            self.input_ids[n:batch].zero_()
        else:
            self.input_ids[:batch].copy_(host_longs[0, :batch], non_blocking=True)
        self.positions[:batch].copy_(host_longs[1, :batch], non_blocking=True)
        self.slots[:batch].copy_(host_longs[2, :batch], non_blocking=True)
        self.context_lens[:batch].copy_(host_ints[:batch, 0], non_blocking=True)
        self.page_table[:batch, :width].copy_(host_ints[:batch, 1 : 1 + width], non_blocking=True)
        return self._replay(batch, n)

    def copy_to_host(self, tokens: torch.Tensor) -> "HostCopy":
        """Start copying `tokens` [n] to pinned host memory; `wait()` returns them as a list."""
        n = tokens.shape[0]
        slot = self._copy_slots[self._next_copy_slot]
        self._next_copy_slot ^= 1
        slot[:n].copy_(tokens, non_blocking=self.on_cuda)
        event = None
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record()
        return HostCopy(slot, n, event)


class _Staging:
    """One set of a decode step's pinned inputs: [ids; positions; KV slots; resource slots...]
    and [context_len, page table...], and which page tables its rows hold."""

    def __init__(self, longs: torch.Tensor, ints: torch.Tensor):
        self.longs, self.ints = longs, ints
        self.written_tables: list[list[int]] = []   # the page tables in `ints`' rows, and their lengths
        self.written_lengths: list[int] = []


class HostCopy:
    """An in-flight device-to-host copy of sampled ids."""

    def __init__(self, buffer: torch.Tensor, count: int, event):
        self.buffer, self.count, self.event = buffer, count, event

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.buffer[: self.count].tolist()
