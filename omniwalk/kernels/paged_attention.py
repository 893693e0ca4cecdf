"""Causal attention of a ragged batch over a paged KV cache: one Triton kernel, and the torch
reference beside it (`paged_attention_reference`, the CPU path: SDPA per sequence).

One kernel serves prefill chunks and decode steps alike. A program handles BLOCK_M query
tokens of one sequence for one KV head, and packs the GROUP query heads that share that
KV head into its rows, so each key/value tile is read once per KV head (GQA):

    program (kv head h, query block m, seq b)
      rows:  r = token_in_block * GROUP + head_in_group         [BLOCK_M * GROUP rows]
      keys:  positions 0 .. min(seq_len, context + (m+1)*BLOCK_M), BLOCK_N at a time,
             each key found through the page table: slot = table[pos // PAGE] * PAGE + pos % PAGE
      mask:  key position <= context_len + token (causal)

Online softmax in fp32 (as flash attention). Runs on CUDA, and on CPU under
TRITON_INTERPRET=1 (how CI checks it against the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.triton_support import triton

if triton is not None:
    import triton.language as tl


def paged_attention(
    query: torch.Tensor,          # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,      # [num_slots, num_kv_heads, head_dim] (one layer's pool)
    value_cache: torch.Tensor,
    query_start: torch.Tensor,    # [B + 1] int32
    context_lens: torch.Tensor,   # [B] int32
    page_table: torch.Tensor,     # [B, max_pages] int32
    page_size: int,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:                # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    # rows = BLOCK_M * GROUP, at least 16 for tl.dot; decode (max_query_len 1) uses one token a block
    block_m = 1 if max_query_len == 1 else max(1, 64 // group)
    rows = max(16, triton.next_power_of_2(block_m * group))
    num_sequences = query_start.shape[0] - 1
    grid = (num_kv_heads, triton.cdiv(max_query_len, block_m), num_sequences)
    # decode: 2 warps do (a program has one query row per head of its group); see
    # a probe at 78d31df: benchmarks/scripts/attention_decode.py; docs/benchmarks.md
    launch = dict(num_warps=2, num_stages=3) if max_query_len == 1 else {}
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out,
        query_start, context_lens, page_table,
        scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, ROWS=rows, BLOCK_N=64 if page_size <= 64 else page_size, PAGE=page_size,
        **launch,
    )
    return out


def paged_attention_reference(
    query: torch.Tensor,          # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,      # [num_slots, num_kv_heads, head_dim] (one layer's pool)
    value_cache: torch.Tensor,
    query_lens: list[int],        # new tokens per sequence
    context_lens: list[int],      # tokens cached per sequence before this pass
    page_tables: list[list[int]],   # pages of each sequence (context + new tokens)
    page_size: int,
    scale: float,
) -> torch.Tensor:                # [num_tokens, num_heads, head_dim]
    """`paged_attention` in torch from the host lists (the CPU path): scaled_dot_product_attention
    per sequence over its gathered pages."""
    outputs = []
    start = 0
    for query_len, context_len, table in zip(query_lens, context_lens, page_tables):
        total = context_len + query_len
        pages = torch.tensor(table, dtype=torch.long, device=query.device)
        slots = (pages[:, None] * page_size + torch.arange(page_size, device=query.device)).flatten()[:total]
        q = query[start : start + query_len].transpose(0, 1)        # [heads, q, dim]
        k = key_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)   # [kv_heads, total, dim]
        v = value_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)
        mask = None
        if query_len > 1:
            # query i sits at absolute position context_len + i and sees keys up to it
            positions = torch.arange(query_len, device=q.device)[:, None] + context_len
            mask = torch.arange(total, device=q.device)[None, :] <= positions
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0],
        )
        outputs.append(out.squeeze(0).transpose(0, 1))
        start += query_len
    return torch.cat(outputs, dim=0)


if triton is not None:

    # The page table's row stride is the eager batch's longest table: any number. Left
    # unspecialized, it does not make Triton compile another variant (~0.5 s, in a step)
    # when a batch's width is odd or 1 where the ones before were multiples of 16.
    @triton.jit(do_not_specialize=["stride_table"])
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        query_start_ptr, context_lens_ptr, page_table_ptr,
        scale,
        stride_q_token, stride_q_head,
        stride_k_slot, stride_k_head,
        stride_o_token, stride_o_head,
        stride_table,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    ):
        # KV heads vary fastest: programs that run together read the same slots' rows (one
        # slot holds every head's key), 3x faster at short decode contexts than sequence-first
        kv_head = tl.program_id(0)
        block = tl.program_id(1)
        seq = tl.program_id(2)

        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        if block * BLOCK_M >= q_len:
            return
        context = tl.load(context_lens_ptr + seq)
        seq_len = context + q_len

        rows = tl.arange(0, ROWS)
        token = block * BLOCK_M + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = (rows < BLOCK_M * GROUP) & (token < q_len)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM

        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        query_pos = context + token

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)

        kv_end = tl.minimum(seq_len, context + (block + 1) * BLOCK_M)
        for start in range(0, kv_end, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            key_valid = key_pos < kv_end
            page = tl.load(page_table_ptr + seq * stride_table + key_pos // PAGE, mask=key_valid, other=0)
            slot = page.to(tl.int64) * PAGE + key_pos % PAGE
            kv_offsets = slot[:, None] * stride_k_slot + kv_head * stride_k_head + dims[None, :]
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + token)[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
