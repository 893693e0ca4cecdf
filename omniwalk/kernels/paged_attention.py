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

A prefill's query blocks are numbered over the whole batch, not per sequence: program
(h, m) finds its sequence b by binary search for the last b with query_start[b] // BLOCK_M
+ b <= m (sequence b's blocks start there, so its cdiv(q_len, BLOCK_M) blocks fit before
b + 1's). The grid, cdiv(tokens, BLOCK_M) + B blocks, then follows the batch's tokens, not
its longest piece: a prefill CUDA graph (`engine/prefill_graphs.py`) must size the grid for
the longest piece its bucket could hold (all of its tokens), which per sequence would be
B x that many programs, nearly all of them idle. A sequence with a negative context length
is a graph's padding: its rows get zeros and no keys are read (the padding of a large
bucket would otherwise attend causally over up to thousands of its own tokens).

Decode of a small batch splits each sequence's keys (flash-decoding): with one program per
(KV head, sequence), batch 1 of a 4-KV-head model keeps 4 of the GPU's 132 SMs busy and
walks its keys one tile after the other. Split S ways, program (kv head, split s, seq)
takes an equal share of the keys and writes its unnormalized partial (max, sum, acc) in
fp32; a second kernel merges the S partials of each (token, head). S depends on the
batch's shape alone (`decode_splits`), so a CUDA graph captures it; shares follow each
sequence's length at run time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.triton_support import pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.triton_support import await_predecessor


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
    max_splits: int | None = None,   # a cap on the decode splits (1: never split)
) -> torch.Tensor:                # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    # rows = BLOCK_M * GROUP, at least 16 for tl.dot; decode (max_query_len 1) uses one token a block
    block_m = 1 if max_query_len == 1 else max(1, 64 // group)
    rows = max(16, triton.next_power_of_2(block_m * group))
    num_sequences = query_start.shape[0] - 1
    max_splits = min(MAX_SPLITS if query.is_cuda else INTERPRETER_MAX_SPLITS, max_splits or MAX_SPLITS)
    splits = decode_splits(num_sequences, num_kv_heads, max_splits) if max_query_len == 1 else 1
    block_d = max(16, triton.next_power_of_2(head_dim))   # tl.dot's K is at least 16; the rest masked
    partial_acc = partial_stats = out
    if splits > 1:   # [tokens, heads, splits, dim] and [tokens, heads, splits, (max, sum)]
        partial_acc = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32, device=query.device)
        partial_stats = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=query.device)
    # axis 1: a prefill's query block over the whole batch (axis 2 then 1), or a decode's key split
    flat = max_query_len > 1
    grid = (num_kv_heads, triton.cdiv(num_tokens, block_m) + num_sequences, 1) if flat else \
        (num_kv_heads, splits, num_sequences)
    # decode: 2 warps do (a program has one query row per head of its group); see
    # a probe at 78d31df: benchmarks/scripts/attention_decode.py; docs/benchmarks.md
    launch = dict(num_warps=2, num_stages=3) if max_query_len == 1 else {}
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, partial_acc, partial_stats,
        query_start, context_lens, page_table,
        scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        out.stride(0), out.stride(1),
        page_table.stride(0), num_sequences,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, ROWS=rows, BLOCK_N=(SPLIT_BLOCK_N if splits > 1 else 64) if page_size <= 64 else page_size,
        PAGE=page_size, SPLITS=splits, FLAT=flat,
        **launch, **pdl_launch(query),
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial_acc, partial_stats, out, out.stride(0), out.stride(1),
            SPLITS=splits, BLOCK_S=splits, HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=1, **pdl_launch(query))
    return out


#: programs a decode step's attention should have at least (H200: 132 SMs), and the most
#: splits of one sequence's keys; a split reads SPLIT_BLOCK_N keys at a time
TARGET_PROGRAMS = 128
MAX_SPLITS = 16
SPLIT_BLOCK_N = 32
#: Triton's interpreter on a CPU (CI) has no SMs to fill and runs one Python call per
#: program (a decode graph's step there ~3x slower split 2 ways): unsplit. The split kernel
#: and its merge are checked on CPU by tests/kernels/test_paged_attention.py, which sets this
INTERPRETER_MAX_SPLITS = 1


def decode_splits(num_sequences: int, num_kv_heads: int, max_splits: int = MAX_SPLITS,
                  target_programs: int | None = None) -> int:
    """How many ways a decode step splits each sequence's keys: 1 once the batch alone
    fills the GPU (`target_programs` programs; TARGET_PROGRAMS by default). A function of
    the batch's shape (not of its lengths): graph-capturable."""
    target = TARGET_PROGRAMS if target_programs is None else target_programs
    wanted = min(max_splits, target // max(1, num_sequences * num_kv_heads))
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1   # a power of two (tl.arange)


def paged_attention_reference(
    query: torch.Tensor,          # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,      # [num_slots, num_kv_heads, head_dim] (one layer's pool)
    value_cache: torch.Tensor,
    query_lens: list[int],        # new tokens per sequence
    context_lens: list[int],      # tokens cached per sequence before this pass (< 0: padding)
    page_tables: list[list[int]],   # pages of each sequence (context + new tokens)
    page_size: int,
    scale: float,
) -> torch.Tensor:                # [num_tokens, num_heads, head_dim]
    """`paged_attention` in torch from the host lists (the CPU path): scaled_dot_product_attention
    per sequence over its gathered pages."""
    outputs = []
    start = 0
    for query_len, context_len, table in zip(query_lens, context_lens, page_tables):
        if context_len < 0:   # a graph's padding sequence (as the kernel: zeros)
            outputs.append(query.new_zeros((query_len, *query.shape[1:])))
            start += query_len
            continue
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
    @triton.jit(do_not_specialize=["stride_table", "num_sequences"])
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_acc_ptr, partial_stats_ptr,
        query_start_ptr, context_lens_ptr, page_table_ptr,
        scale,
        stride_q_token, stride_q_head,
        stride_k_slot, stride_k_head,
        stride_o_token, stride_o_head,
        stride_table, num_sequences,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        SPLITS: tl.constexpr, FLAT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_predecessor(PDL)
        # KV heads vary fastest: programs that run together read the same slots' rows (one
        # slot holds every head's key), 3x faster at short decode contexts than sequence-first
        kv_head = tl.program_id(0)
        if FLAT:   # the batch's query block m: the last sequence whose blocks start at or before it
            target = tl.program_id(1)
            low = 0
            high = num_sequences
            while low < high:
                middle = (low + high) // 2
                if tl.load(query_start_ptr + middle) // BLOCK_M + middle <= target:
                    low = middle + 1
                else:
                    high = middle
            seq = low - 1
            block = target - (tl.load(query_start_ptr + seq) // BLOCK_M + seq)
        else:
            block = tl.program_id(1) if SPLITS == 1 else 0
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
        if context < 0:   # a graph's padding sequence: zeros, no keys read
            tl.store(out_ptr + (q_start + token)[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
                     tl.zeros([ROWS, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=row_valid[:, None] & dim_valid[None, :])
            return

        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        query_pos = context + token

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)

        kv_end = tl.minimum(seq_len, context + (block + 1) * BLOCK_M)
        kv_start = 0
        if SPLITS > 1:   # this program's share of the keys: whole tiles, the last share shorter
            split = tl.program_id(1)
            share = tl.cdiv(tl.cdiv(kv_end, SPLITS), BLOCK_N) * BLOCK_N
            kv_start = split * share
            kv_end = tl.minimum(kv_end, kv_start + share)
        for start in range(kv_start, kv_end, BLOCK_N):
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

        if SPLITS > 1:   # unnormalized, for _merge_splits_kernel (a share past the end: max -inf, sum 0)
            num_heads = tl.num_programs(0) * GROUP
            row = ((q_start + token) * num_heads + head) * SPLITS + tl.program_id(1)
            tl.store(partial_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], acc, mask=row_valid[:, None])
            tl.store(partial_stats_ptr + row * 2, m_i, mask=row_valid)
            tl.store(partial_stats_ptr + row * 2 + 1, l_i, mask=row_valid)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + token)[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])

    @triton.jit
    def _merge_splits_kernel(partial_acc_ptr, partial_stats_ptr, out_ptr, stride_o_token, stride_o_head,
                             SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        """out[token, head] from its SPLITS partials: each rescaled to the overall max.
        BLOCK_S: SPLITS rounded up to a power of two (tl.arange); cross-attention may split 3 ways."""
        await_predecessor(PDL)
        token = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.arange(0, BLOCK_S)
        present = split < SPLITS
        row = (token * tl.num_programs(1) + head) * SPLITS + split
        dims = tl.arange(0, BLOCK_D)
        m = tl.load(partial_stats_ptr + row * 2, mask=present, other=float("-inf"))
        l = tl.load(partial_stats_ptr + row * 2 + 1, mask=present, other=0.0)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)   # nothing visible at all
        weight = tl.exp(m - m_max)                             # a share past the end: 0
        acc = tl.load(partial_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], mask=present[:, None], other=0.0)
        total = tl.sum(weight * l, axis=0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + token * stride_o_token + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)
