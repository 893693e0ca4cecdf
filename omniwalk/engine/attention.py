"""Attention over a paged KV cache for one ragged batch.

A forward pass covers B sequences; sequence b brings `query_lens[b]` new tokens whose
keys/values are appended after its `context_lens[b]` cached tokens. Prefill chunks and
decode steps (query_len == 1) mix freely in one batch:

    flat tokens:   [ seq0: 5 prefill tokens | seq1: 1 decode token | seq2: 3 chunk tokens ]
    query_start:   [0, 5, 6, 9]
    context_lens:  [0, 41, 128]

Model code calls `PagedAttention.forward(layer_index, q, k, v)`; the layer never sees
pages or slots. On CUDA the Triton kernel (`omniwalk.kernels.paged_attention`) reads the
device tensors of the metadata; on CPU its torch reference runs SDPA per sequence from the
host lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.kernels.norm_rotary import QKRotary, norm_rotary_into_cache
from omniwalk.kernels.paged_attention import paged_attention, paged_attention_reference
from omniwalk.kernels.triton_support import kernel_runs_on


@dataclass
class AttentionMetadata:
    """What one forward pass needs to know about the layout of its batch."""

    slot_mapping: torch.Tensor      # [num_tokens] int64: where each new token's k/v goes
    # Host lists: the CPU path (SDPA per sequence)
    query_lens: list[int] | None = None          # new tokens per sequence
    context_lens: list[int] | None = None        # tokens cached per sequence before this pass
    page_tables: list[list[int]] | None = None   # pages of each sequence (context + new tokens)
    # Device tensors: the Triton path (fixed shapes under CUDA graphs)
    query_start: torch.Tensor | None = None          # [B + 1] int32
    context_lens_tensor: torch.Tensor | None = None  # [B] int32
    page_table_tensor: torch.Tensor | None = None    # [B, max_pages] int32
    max_query_len: int = 0

    def host_lists(self, page_size: int) -> tuple[list[int], list[int], list[list[int]]]:
        """(query_lens, context_lens, page_tables): the host lists, or read back from the device
        tensors when only those exist (a decode graph's step run without a kernel to launch)."""
        if self.page_tables is not None:
            return self.query_lens, self.context_lens, self.page_tables
        query_lens = self.query_start.diff().tolist()
        context_lens = self.context_lens_tensor.tolist()
        tables = [row[: -(-(c + q) // page_size)] for row, c, q in
                  zip(self.page_table_tensor.tolist(), context_lens, query_lens)]
        return query_lens, context_lens, tables


class PagedAttention:
    """Writes new keys/values into the cache and attends over each sequence's pages.

    CPU path: `paged_attention_reference`, torch SDPA per sequence over its gathered pages.
    """

    def __init__(self, cache: PagedKVCache, metadata: AttentionMetadata):
        self.cache = cache
        self.metadata = metadata
        # the kernel needs CUDA, or Triton's interpreter on a CPU (how CI runs it)
        self.use_triton = metadata.page_table_tensor is not None and kernel_runs_on(cache.keys)

    def forward(
        self,
        layer_index: int,
        query: torch.Tensor,   # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,     # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,   # [num_tokens, num_kv_heads, head_dim]
        scale: float,
        rotary: QKRotary | None = None,
        max_splits: int | None = None,
    ) -> torch.Tensor:         # [num_tokens, num_heads, head_dim]
        """`rotary`: normalize and rotate query and key first (`kernels.norm_rotary`); on
        CUDA one kernel does that and the cache write. `max_splits`: a cap on how many ways
        a decode step splits each sequence's keys (`kernels.paged_attention`; 1: never)."""
        meta = self.metadata
        key_pool = self.cache.keys[layer_index]
        value_pool = self.cache.values[layer_index]
        if rotary is not None:
            query = norm_rotary_into_cache(query, key, value, rotary, key_pool, value_pool, meta.slot_mapping)
        else:
            key_pool.index_copy_(0, meta.slot_mapping, key.to(key_pool.dtype))
            value_pool.index_copy_(0, meta.slot_mapping, value.to(value_pool.dtype))
        if self.use_triton:
            return paged_attention(
                query, key_pool, value_pool, meta.query_start, meta.context_lens_tensor,
                meta.page_table_tensor, self.cache.page_size, meta.max_query_len, scale, max_splits,
            )
        return paged_attention_reference(query, key_pool, value_pool, *meta.host_lists(self.cache.page_size),
                                         self.cache.page_size, scale)


def build_metadata(
    cache: PagedKVCache, handles: list[int], context_lens: list[int], query_lens: list[int], device,
    use_triton: bool | None = None,
) -> AttentionMetadata:
    """Metadata for a batch whose pages were already reserved in `cache`.

    `use_triton` defaults to whether `device` is CUDA."""
    device = torch.device(device)
    slots: list[int] = []
    for handle, context_len, query_len in zip(handles, context_lens, query_lens):
        slots.extend(cache.slots(handle, context_len, context_len + query_len))
    page_tables = [cache.page_tables[h] for h in handles]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        query_lens=list(query_lens), context_lens=list(context_lens), page_tables=page_tables,
    )
    if use_triton if use_triton is not None else device.type == "cuda":
        width = max(len(table) for table in page_tables)
        padded = [table + [0] * (width - len(table)) for table in page_tables]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        meta.query_start = torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True)
        meta.context_lens_tensor = torch.tensor(context_lens, dtype=torch.int32).to(device, non_blocking=True)
        meta.page_table_tensor = torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True)
        meta.max_query_len = max(query_lens)
    return meta


def attention_for_tests(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int,
                        dtype=torch.float32, device="cpu") -> PagedAttention:
    """A one-sequence prefill context: lets model code run a plain forward without the engine."""
    from omniwalk.engine.kv_cache import KVCacheShape

    page_size = 16
    shape = KVCacheShape(num_layers, num_kv_heads, head_dim, page_size, num_pages=-(-seq_len // page_size))
    cache = PagedKVCache(shape, dtype, device)
    cache.reserve(0, seq_len)
    return PagedAttention(cache, build_metadata(cache, [0], [0], [seq_len], device))
