"""Paged KV cache: a pool of fixed-size pages shared by all sequences of one node.

Each sequence owns a page table, the list of pages holding its tokens in order:

    token position:   0 1 2 3 | 4 5 6 7 | 8 9
    page table:       [  17   ,   3     ,  42 ]         (page_size = 4)
    slot of token 9:  42 * 4 + (9 % 4) = 170

A slot is the flat index of one token's key/value in the pool, so writing the keys
of a ragged batch is one scatter over `slot_mapping`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PageAllocator:
    """Free list of page indices. Check with `can_allocate`, then `allocate`."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} pages with {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_page(self, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * element


class PagedKVCache:
    """Key/value pools for every layer of one node, plus the page tables of its sequences.

    Sequences are identified by integer handles chosen by the caller.
    """

    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device | str):
        self.shape = shape
        self.page_size = shape.page_size
        # keys/values: [num_layers, num_pages * page_size, num_kv_heads, head_dim]
        pool = (shape.num_layers, shape.num_pages * shape.page_size, shape.num_kv_heads, shape.head_dim)
        self.keys = torch.zeros(pool, dtype=dtype, device=device)
        self.values = torch.zeros(pool, dtype=dtype, device=device)
        self.allocator = PageAllocator(shape.num_pages)
        self.page_tables: dict[int, list[int]] = {}

    def pages_needed(self, handle: int, num_tokens: int) -> int:
        """Extra pages `handle` needs to hold `num_tokens` tokens in total."""
        have = len(self.page_tables.get(handle, ()))
        return max(0, -(-num_tokens // self.page_size) - have)

    def can_reserve(self, handle: int, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.pages_needed(handle, num_tokens))

    def reserve(self, handle: int, num_tokens: int) -> None:
        """Grow `handle`'s page table so it can hold `num_tokens` tokens."""
        extra = self.pages_needed(handle, num_tokens)
        table = self.page_tables.setdefault(handle, [])
        if extra:
            table.extend(self.allocator.allocate(extra))

    def free(self, handle: int) -> None:
        pages = self.page_tables.pop(handle, None)
        if pages:
            self.allocator.free(pages)

    def slots(self, handle: int, start: int, end: int) -> list[int]:
        """Flat slot indices of token positions [start, end) of `handle`."""
        table = self.page_tables[handle]
        size = self.page_size
        return [table[pos // size] * size + pos % size for pos in range(start, end)]
