"""Decode attention over the paged KV cache at Orpheus-3B's shape (24 query heads, 8 KV
heads, head dim 128, page 16): the kernel's launch parameters and the cache layout.

    python3 benchmarks/scripts/attention_decode.py      (CUDA)

Prints, per (batch, context, layout, BLOCK_N, warps, stages): microseconds per layer and
the KV bytes read per second. Layouts: "slot" = [slots, kv heads, dim] (the cache's now),
"page" = [pages, kv heads, page, dim] (a page of one head contiguous).
"""
import itertools, sys, torch, triton, triton.language as tl


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, out_ptr, context_lens_ptr, page_table_ptr, scale,
            stride_q_token, stride_q_head, stride_page, stride_offset, stride_head,
            stride_o_token, stride_o_head, stride_table,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGE: tl.constexpr, SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_lens_ptr + seq)
    seq_len = context + 1
    rows = tl.arange(0, ROWS)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < hi
        page = tl.load(page_table_ptr + seq * stride_table + key_pos // PAGE, mask=key_valid, other=0)
        offs = page.to(tl.int64) * stride_page + (key_pos % PAGE) * stride_offset + kv_head * stride_head
        k = tl.load(k_ptr + offs[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        scores = tl.where(key_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + seq * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def run(batch, context, layout, block_n, warps, stages, splits=1, heads=24, kv_heads=8, dim=128, page=16):
    dev, dt = "cuda", torch.bfloat16
    pages_per_seq = -(-(context + 1) // page)
    num_pages = batch * pages_per_seq + 1
    table = torch.randperm(num_pages - 1, device=dev)[: batch * pages_per_seq].view(batch, pages_per_seq).int()
    if layout == "slot":
        k = torch.randn(num_pages * page, kv_heads, dim, device=dev, dtype=dt)
        strides = (page * kv_heads * dim, kv_heads * dim, dim)
    else:
        k = torch.randn(num_pages, kv_heads, page, dim, device=dev, dtype=dt)
        strides = (kv_heads * page * dim, dim, page * dim)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, dim, device=dev, dtype=dt)
    out = torch.empty_like(q)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
    group = heads // kv_heads
    def call():
        _kernel[(batch, kv_heads, splits)](q, k, v, out, ctx, table, dim ** -0.5, q.stride(0), q.stride(1), *strides,
                                          out.stride(0), out.stride(1), table.stride(0), GROUP=group, HEAD_DIM=dim,
                                          ROWS=16, BLOCK_N=block_n, PAGE=page, SPLITS=splits,
                                          num_warps=warps, num_stages=stages)
    for _ in range(3): call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50): call()
    end.record(); torch.cuda.synchronize()
    us = start.elapsed_time(end) / 50 * 1e3
    kv_bytes = 2 * batch * (context + 1) * kv_heads * dim * 2
    return us, kv_bytes / us / 1e3   # GB/s


if __name__ == "__main__":
    from omniwalk.kernels.paged_attention import paged_attention
    for batch, context in ((256, 64), (256, 360), (256, 700)):
        # the kernel as shipped, through its wrapper
        pages_per_seq = -(-(context + 1) // 16)
        num_pages = batch * pages_per_seq + 1
        k = torch.randn(num_pages * 16, 8, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
        q = torch.randn(batch, 24, 128, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(num_pages - 1, device="cuda")[: batch * pages_per_seq].view(batch, pages_per_seq).int()
        qs = torch.arange(batch + 1, dtype=torch.int32, device="cuda"); ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        f = lambda: paged_attention(q, k, v, qs, ctx, table, 16, 1, 128 ** -0.5)
        for _ in range(3): f()
        torch.cuda.synchronize(); s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); [f() for _ in range(50)]; e.record(); torch.cuda.synchronize()
        us = s.elapsed_time(e) / 50 * 1e3
        print(f"B={batch} ctx={context} shipped: {us:.1f} us {2*batch*(context+1)*8*128*2/us/1e3:.0f} GB/s", flush=True)
        results = []
        for layout, block_n, warps, stages, splits in itertools.product(("slot", "page"), (32, 64, 128), (2, 4), (2, 3, 4), (1, 2)):
            try:
                us, gbs = run(batch, context, layout, block_n, warps, stages, splits)
            except Exception as exc:
                continue
            results.append((us, layout, block_n, warps, stages, splits, gbs))
        results.sort()
        for us, layout, block_n, warps, stages, splits, gbs in results[:8]:
            print(f"  {layout:4s} BLOCK_N={block_n:3d} warps={warps} stages={stages} splits={splits}: {us:7.1f} us {gbs:5.0f} GB/s")
        best = {l: min(r for r in results if r[1] == l) for l in ("slot", "page")}
        print("  best per layout:", {l: f"{r[0]:.1f} us" for l, r in best.items()}, flush=True)
