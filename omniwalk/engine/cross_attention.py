"""Cross-attention keys/values of an encoder-decoder node: one fixed-size slot per stream.

An encoder-decoder (Whisper) attends from every decoder token to the same encoder
output. Its keys/values are computed once per stream (at prefill, from the encoder
states) and read by every decode step, so they live in a pool of equal slots:

    keys:    [num_layers, num_slots, source_len, num_heads, head_dim]   (values alike)
    slot s of layer l:  keys[l, s]  -> [source_len (1500), heads, head_dim]

    stream handle 7 -> slot 2      stream handle 12 -> slot 0     (free: 1, 3, ...)

Check/act: `can_allocate()` then `allocate(handle)`; `free(handle)` at the stream's end.
`CrossAttention` is the per-batch view model code calls, like `PagedAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omniwalk.kernels.triton_support import triton, use_triton

if triton is not None:
    import triton.language as tl


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

    def write(self, handles: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values: [num_layers, len(handles), source_len, num_heads, head_dim]."""
        slots = torch.tensor([self.slot_of[h] for h in handles], dtype=torch.long, device=self.keys.device)
        self.keys[:, slots] = keys.to(self.keys.dtype)
        self.values[:, slots] = values.to(self.values.dtype)


class CrossAttention:
    """One forward pass's cross-attention: the queries of sequence b (`query_lens[b]`
    consecutive rows of the flat batch) attend over all of its slot's positions."""

    def __init__(self, cache: CrossAttentionCache, handles: list[int], query_lens: list[int]):
        self.cache = cache
        self.query_lens = list(query_lens)
        self.slots = [cache.slot_of[h] for h in handles]
        self.uniform = len(set(self.query_lens)) == 1
        self.slot_index = torch.tensor(self.slots, dtype=torch.long, device=cache.keys.device)

    @classmethod
    def for_decode_graph(cls, cache: CrossAttentionCache, slot_index: torch.Tensor) -> "CrossAttention":
        """One query per row over the slots `slot_index` holds when the step runs (a CUDA
        graph's static input buffer)."""
        view = cls.__new__(cls)
        view.cache, view.slot_index = cache, slot_index
        view.query_lens = [1] * len(slot_index)
        view.slots = None   # only the uniform path runs: it reads slot_index
        view.uniform = True
        return view

    def forward(self, layer_index: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        # query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]
        keys, values = self.cache.keys[layer_index], self.cache.values[layer_index]   # [slots, S, H, D]
        if self.uniform and self.query_lens[0] == 1 and use_triton(query):
            # decode steps on CUDA: read each row's slot in place (a gather would copy
            # 2 x 1500 x heads x head_dim values per row and layer, every step)
            return cross_attention_decode(query, keys, values, self.slot_index, scale)
        if self.uniform:   # decode steps (and equal chunks): one batched SDPA
            batch, q_len = len(self.slot_index), self.query_lens[0]
            q = query.view(batch, q_len, *query.shape[1:]).transpose(1, 2)             # [B, H, q, D]
            k = keys.index_select(0, self.slot_index).transpose(1, 2).to(q.dtype)     # [B, H, S, D]
            v = values.index_select(0, self.slot_index).transpose(1, 2).to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
            return out.transpose(1, 2).reshape(query.shape)
        outputs, start = [], 0
        for slot, q_len in zip(self.slots, self.query_lens):
            q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)              # [1, H, q, D]
            k = keys[slot].transpose(0, 1).unsqueeze(0).to(q.dtype)                    # [1, H, S, D]
            v = values[slot].transpose(0, 1).unsqueeze(0).to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
            outputs.append(out.squeeze(0).transpose(0, 1))
            start += q_len
        return torch.cat(outputs, dim=0)


def cross_attention_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           slot_index: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row over its slot's keys, in one Triton kernel.

    query [rows, heads, head_dim]; keys, values [num_slots, source_len, heads, head_dim] (one
    layer of the pool); slot_index [rows]. Returns [rows, heads, head_dim] in query's dtype."""
    rows, heads, head_dim = query.shape
    if keys.stride() != values.stride():
        raise ValueError("keys and values must share one layout")
    out = torch.empty_like(query)
    if rows:
        _cross_decode_kernel[(rows, heads)](
            query, keys, values, slot_index, out, scale,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            out.stride(0), out.stride(1), keys.shape[1],
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=64)
    return out


if triton is not None:

    @triton.jit
    def _cross_decode_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, out_ptr, scale,
                             stride_q_row, stride_q_head, stride_slot, stride_pos, stride_head,
                             stride_o_row, stride_o_head, source_len,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + dims, mask=dim_valid, other=0.0)
        q = q.to(tl.float32) * scale
        base = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + head * stride_head
        m_i = tl.full((), float("-inf"), tl.float32)    # online softmax over the source positions
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, source_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < source_len
            offsets = base + pos[:, None] * stride_pos + dims[None, :]
            mask = valid[:, None] & dim_valid[None, :]
            k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            scores = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            p = tl.exp(scores - m_new)
            correction = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * correction + tl.sum(p, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(out_ptr + row * stride_o_row + head * stride_o_head + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dim_valid)
