"""Cross-attention keys/values of an encoder-decoder node: one fixed-size slot per stream.

An encoder-decoder (Whisper) attends from every decoder token to the same encoder
output. Its keys/values are computed once per stream (at prefill, from the encoder
states) and read by every decode step, so they live in a pool of equal slots:

    keys:    [num_layers, num_slots, source_len, num_heads, head_dim]   (values alike)
    slot s of layer l:  keys[l, s]  -> [source_len (1500), heads, head_dim]

    stream handle 7 -> slot 2      stream handle 12 -> slot 0     (free: 1, 3, ...)

Check/act: `can_allocate()` then `allocate(handle)`; `free(handle)` at the stream's end.
`CrossAttention` is the per-batch view model code calls, like `PagedAttention`; its decode
step is a kernel of `omniwalk.kernels.cross_attention` on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omniwalk.engine.host_to_device import to_device
from omniwalk.engine.ragged import RaggedLengths
from omniwalk.kernels.cross_attention import cross_attention_decode, cross_attention_reference
from omniwalk.kernels.triton_support import use_triton


@dataclass(frozen=True)
class CrossAttentionShape:
    num_layers: int
    num_slots: int
    source_len: int       # encoder positions every slot holds (Whisper: 1500)
    num_heads: int
    head_dim: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.source_len * self.num_heads * self.head_dim * element


class CrossAttentionCache:
    """The slot pool. Streams are identified by integer handles chosen by the caller."""

    def __init__(self, shape: CrossAttentionShape, dtype: torch.dtype, device: torch.device | str):
        if shape.num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {shape.num_slots}")
        self.shape = shape
        pool = (shape.num_layers, shape.num_slots, shape.source_len, shape.num_heads, shape.head_dim)
        self.keys = torch.zeros(pool, dtype=dtype, device=device)
        self.values = torch.zeros(pool, dtype=dtype, device=device)
        self._free = list(range(shape.num_slots - 1, -1, -1))   # low slots first
        self.slot_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def has(self, handle: int) -> bool:
        return handle in self.slot_of

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self, handle: int) -> int:
        if handle in self.slot_of:
            return self.slot_of[handle]
        if not self._free:
            raise RuntimeError("no free cross-attention slot")
        slot = self.slot_of[handle] = self._free.pop()
        return slot

    def free(self, handle: int) -> None:
        slot = self.slot_of.pop(handle, None)
        if slot is not None:
            self._free.append(slot)

    # as a decode graph's `SlotResource`: a row reads its slot, decode steps write nothing
    slots_per_row = 1

    def row_slots(self, handle: int) -> tuple[int]:
        return (self.slot_of[handle],)

    def decode_view(self, row_slots: torch.Tensor) -> "CrossAttention":
        return CrossAttention.for_decode_graph(self, row_slots[0])

    def prefill_view(self, row_slots: torch.Tensor, ragged: RaggedLengths) -> "CrossAttention":
        """As a prefill graph's `SlotResource`: `row_slots` [1, sequences], `ragged` the
        graph's layout buffers (`engine/prefill_graphs.py`)."""
        return CrossAttention.for_prefill_graph(self, row_slots[0], ragged)

    def slot_index(self, handles: list[int]) -> torch.Tensor:
        """The slots of `handles` on the pool's device (queued, no host wait)."""
        return to_device([self.slot_of[h] for h in handles], torch.long, self.keys.device)

    def write_layer(self, layer_index: int, slot_index: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> None:
        """keys/values [len(slot_index), source_len, num_heads, head_dim] of one layer, into
        the slots `slot_index` (one copy each, straight from the projection's output)."""
        self.keys[layer_index].index_copy_(0, slot_index, keys.to(self.keys.dtype))
        self.values[layer_index].index_copy_(0, slot_index, values.to(self.values.dtype))


#: the most query tokens of one stream that the decode kernel takes as rows (see CrossAttention)
PER_TOKEN_MAX_QUERY_LEN = 32


class CrossAttention:
    """One forward pass's cross-attention: the queries of sequence b (`query_lens[b]`
    consecutive rows of the flat batch) attend over all of its slot's positions."""

    def __init__(self, cache: CrossAttentionCache, handles: list[int], query_lens: list[int]):
        self.cache = cache
        self.query_lens = list(query_lens)
        self.slots = [cache.slot_of[h] for h in handles]
        self.uniform = len(set(self.query_lens)) == 1
        device = cache.keys.device
        self.slot_index = to_device(self.slots, torch.long, device)
        # Every query token attends to all of its stream's slot (the source has no causal
        # mask), so on CUDA a prefill's tokens are rows of the decode kernel, each naming its
        # stream's slot. A batch mixing decode rows with new windows' prompts then reads in
        # place too, where a loop of one SDPA per stream and layer cost ~64 ms of host time
        # for a batch of 16 (the c = 32 step probe at 31f317b). A long prompt (previous-text
        # conditioning: up to 224 tokens) would read its slot once per token: such a batch
        # takes the SDPA paths below.
        self.token_slot_index = self.slot_index
        self.per_token = max(self.query_lens, default=1) <= PER_TOKEN_MAX_QUERY_LEN
        if self.per_token and any(n != 1 for n in self.query_lens):
            self.token_slot_index = to_device([slot for slot, n in zip(self.slots, self.query_lens)
                                               for _ in range(n)], torch.long, device)

    @classmethod
    def for_decode_graph(cls, cache: CrossAttentionCache, slot_index: torch.Tensor) -> "CrossAttention":
        """One query per row over the slots `slot_index` holds when the step runs (a CUDA
        graph's static input buffer)."""
        view = cls.__new__(cls)
        view.cache, view.slot_index = cache, slot_index
        view.query_lens = [1] * len(slot_index)
        view.slots = None   # only the uniform paths run: they read slot_index
        view.uniform = True
        view.token_slot_index = slot_index
        view.per_token = True
        return view

    @classmethod
    def for_prefill_graph(cls, cache: CrossAttentionCache, slot_index: torch.Tensor,
                          ragged: RaggedLengths) -> "CrossAttention":
        """The tokens of a prefill graph's ragged batch, each over its sequence's slot
        (`slot_index` [sequences], padding sequences included). Captured on CUDA: each token's
        slot is gathered in the graph from the layout's cu_seqlens, so it holds whatever batch
        a replay brings. On a CPU (nothing captured) the host's lengths and slots serve."""
        view = cls.__new__(cls)
        view.cache, view.slot_index = cache, slot_index
        view.per_token = True
        view.ragged = ragged
        view.token_slot_index = None      # made by the first layer's call, shared by the rest
        view.query_lens = None if ragged.lengths is None else list(ragged.lengths)
        view.slots = None if ragged.lengths is None else slot_index.tolist()
        view.uniform = view.query_lens is not None and len(set(view.query_lens)) == 1
        return view

    def _token_slots(self, num_tokens: int) -> torch.Tensor:
        if self.token_slot_index is None:   # a prefill graph's view: token t is in sequence #ends <= t
            tokens = torch.arange(num_tokens, device=self.slot_index.device)
            sequence = torch.searchsorted(self.ragged.cu_seqlens[1:], tokens, right=True)
            self.token_slot_index = self.slot_index[sequence]
        return self.token_slot_index

    def forward(self, layer_index: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]
        keys, values = self.cache.keys[layer_index], self.cache.values[layer_index]   # [slots, S, H, D]
        if self.per_token and use_triton(query):
            # on CUDA each token reads its slot in place (a gather would copy
            # 2 x 1500 x heads x head_dim values per token and layer, every step)
            return cross_attention_decode(query, keys, values, self._token_slots(query.shape[0]), scale)
        if self.uniform:   # decode steps (and equal chunks): one batched SDPA
            return cross_attention_reference(query, keys, values, self.slot_index, scale, self.query_lens[0])
        outputs, start = [], 0
        for slot, q_len in zip(self.slots, self.query_lens):
            q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)              # [1, H, q, D]
            k = keys[slot].transpose(0, 1).unsqueeze(0).to(q.dtype)                    # [1, H, S, D]
            v = values[slot].transpose(0, 1).unsqueeze(0).to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
            outputs.append(out.squeeze(0).transpose(0, 1))
            start += q_len
        return torch.cat(outputs, dim=0)
