"""Paged KV cache: a pool of fixed-size pages shared by all sequences of one node.

Each sequence owns a page table, the list of pages holding its tokens in order:

    token position:   0 1 2 3 | 4 5 6 7 | 8 9
    page table:       [  17   ,   3     ,  42 ]         (page_size = 4)
    slot of token 9:  42 * 4 + (9 % 4) = 170

A slot is the flat index of one token's key/value in the pool, so writing the keys
of a ragged batch is one scatter over `slot_mapping`.

Prefix caching: a full page is identified by its tokens and everything before them
(key = (key of the previous page, tokens of this page)). A new sequence whose prompt
starts with pages already cached shares them instead of computing them:

    cached:    [A B C D]=p7 -> [E F G H]=p2
    prompt:     A B C D   E F G H   I J        -> page table [p7, p2, new]; 8 tokens skipped

Shared pages are reference counted. A page nobody uses but whose key is known stays
cached (evictable, least recently freed first) until the allocator needs it.
"""

from __future__ import annotations

from collections import OrderedDict

from dataclasses import dataclass

import torch


class PageAllocator:
    """Free pages, plus cached pages nobody uses (reclaimed when the free list runs dry).

    Check with `can_allocate`, then `allocate`."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self.evictable: OrderedDict[int, object] = OrderedDict()   # page -> its prefix key
        self.on_evict = lambda key: None

    @property
    def num_free(self) -> int:
        """Pages a new allocation can get (free or evictable)."""
        return len(self._free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} pages with {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                pages.append(self._free.pop())
            else:   # reclaim the least recently freed cached page
                page, key = self.evictable.popitem(last=False)
                self.on_evict(key)
                pages.append(page)
        return pages

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

    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device | str,
                 enable_prefix_caching: bool = False):
        self.shape = shape
        self.page_size = shape.page_size
        # keys/values: [num_layers, num_pages * page_size, num_kv_heads, head_dim]
        pool = (shape.num_layers, shape.num_pages * shape.page_size, shape.num_kv_heads, shape.head_dim)
        self.keys = torch.zeros(pool, dtype=dtype, device=device)
        self.values = torch.zeros(pool, dtype=dtype, device=device)
        self.allocator = PageAllocator(shape.num_pages)
        self.page_tables: dict[int, list[int]] = {}
        # prefix caching
        self.enable_prefix_caching = enable_prefix_caching
        self.cached_pages: dict[object, int] = {}     # prefix key -> page holding it
        self.page_refs: dict[int, int] = {}           # page -> sequences using it (cached pages)
        self.key_of_page: dict[int, object] = {}      # cached page -> its prefix key
        self.page_keys: dict[int, list] = {}          # handle -> keys of its full pages, in order
        self.num_cached_tokens_hit = 0
        self.allocator.on_evict = self._forget

    def _forget(self, key) -> None:
        page = self.cached_pages.pop(key)
        self.page_refs.pop(page, None)
        self.key_of_page.pop(page, None)

    def match_prefix(self, handle: int, token_ids: list[int]) -> int:
        """Share the cached full pages that begin `token_ids`; returns the tokens covered.

        At least the last token is left to compute: its logits are what the caller needs."""
        if not self.enable_prefix_caching:
            return 0
        table = self.page_tables.setdefault(handle, [])
        keys = self.page_keys.setdefault(handle, [])
        if table:
            return 0
        size = self.page_size
        key = None
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            key = (key, tuple(token_ids[start : start + size]))
            page = self.cached_pages.get(key)
            if page is None:
                break
            if self.page_refs.get(page, 0) == 0:
                self.allocator.evictable.pop(page, None)
            self.page_refs[page] = self.page_refs.get(page, 0) + 1
            table.append(page)
            keys.append(key)
        self.num_cached_tokens_hit += len(table) * size
        return len(table) * size

    def register_full_pages(self, handle: int, token_ids: list[int], num_computed: int) -> None:
        """Make the full pages among the first `num_computed` tokens findable by later prompts."""
        if not self.enable_prefix_caching:
            return
        table = self.page_tables[handle]
        keys = self.page_keys.setdefault(handle, [])
        size = self.page_size
        for index in range(len(keys), num_computed // size):
            key = (keys[-1] if keys else None, tuple(token_ids[index * size : (index + 1) * size]))
            keys.append(key)
            page = table[index]
            if key not in self.cached_pages and page not in self.page_refs:
                self.cached_pages[key] = page
                self.key_of_page[page] = key
                self.page_refs[page] = 1

    # The three below run for every row of every step (a decode step needs a new page
    # once per page_size tokens): plain arithmetic, no calls on the common path.

    def pages_needed(self, handle: int, num_tokens: int) -> int:
        """Extra pages `handle` needs to hold `num_tokens` tokens in total."""
        table = self.page_tables.get(handle)
        extra = -(-num_tokens // self.page_size) - (len(table) if table else 0)
        return extra if extra > 0 else 0

    def can_reserve(self, handle: int, num_tokens: int) -> bool:
        table = self.page_tables.get(handle)
        if table and num_tokens <= len(table) * self.page_size:
            return True
        return self.pages_needed(handle, num_tokens) <= self.allocator.num_free

    def reserve(self, handle: int, num_tokens: int) -> None:
        """Grow `handle`'s page table so it can hold `num_tokens` tokens."""
        table = self.page_tables.get(handle)
        if table is None:
            table = self.page_tables[handle] = []
        elif num_tokens <= len(table) * self.page_size:
            return
        extra = self.pages_needed(handle, num_tokens)
        if extra:
            table.extend(self.allocator.allocate(extra))

    def can_reserve_anew(self, handle: int, num_tokens: int) -> bool:
        """Whether `handle` could hold `num_tokens` tokens from position 0 once `free(handle)`
        gave its pages back (the check for `free`, then `reserve`: a sequence started over)."""
        returned = sum(1 for page in self.page_tables.get(handle, ()) if self.page_refs.get(page, 0) <= 1)
        return -(-num_tokens // self.page_size) <= self.allocator.num_free + returned

    def free(self, handle: int) -> None:
        pages = self.page_tables.pop(handle, None)
        self.page_keys.pop(handle, None)
        if not pages:
            return
        plain = []
        for page in pages:
            refs = self.page_refs.get(page)
            if refs is None:
                plain.append(page)
            elif refs > 1:
                self.page_refs[page] = refs - 1
            else:   # unused but still findable: evictable, most recently freed last
                self.page_refs[page] = 0
                self.allocator.evictable[page] = self.key_of_page[page]
        self.allocator.free(plain)

    def slots(self, handle: int, start: int, end: int) -> list[int]:
        """Flat slot indices of token positions [start, end) of `handle`."""
        table = self.page_tables[handle]
        size = self.page_size
        return [table[pos // size] * size + pos % size for pos in range(start, end)]
