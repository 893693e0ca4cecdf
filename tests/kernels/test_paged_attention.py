"""The Triton paged-attention kernel against its torch reference (SDPA) on random paged layouts.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), so CI checks the
same kernel code the GPU runs; `-m gpu` runs it on CUDA in bf16 too."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton compiles anything here

triton = pytest.importorskip("triton")

from omniwalk.engine.attention import PagedAttention, build_metadata  # noqa: E402
from omniwalk.engine.kv_cache import KVCacheShape, PagedKVCache  # noqa: E402


def random_batch(seed, num_heads, num_kv_heads, head_dim, page_size, device, dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    batch = rng.randint(1, 5)
    context_lens = [rng.choice([0, rng.randint(0, 3 * page_size + 1)]) for _ in range(batch)]
    query_lens = [rng.choice([1, rng.randint(1, 2 * page_size + 3)]) for _ in range(batch)]
    shape = KVCacheShape(1, num_kv_heads, head_dim, page_size, num_pages=64)
    cache = PagedKVCache(shape, dtype, device)
    cache.keys.normal_()
    cache.values.normal_()
    scrambled = list(range(64))
    rng.shuffle(scrambled)
    cache.allocator._free = scrambled    # pages in random order: tables cross page boundaries anywhere
    for handle, (context, query) in enumerate(zip(context_lens, query_lens)):
        cache.reserve(handle, context + query)
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
    return cache, list(range(batch)), context_lens, query_lens, q, k, v


def compare(seed, num_heads, num_kv_heads, head_dim, page_size, device="cpu", dtype=torch.float32, tol=1e-5):
    cache, handles, context_lens, query_lens, q, k, v = random_batch(
        seed, num_heads, num_kv_heads, head_dim, page_size, device, dtype)
    scale = head_dim ** -0.5
    sdpa_meta = build_metadata(cache, handles, context_lens, query_lens, device, use_triton=False)
    expected = PagedAttention(cache, sdpa_meta).forward(0, q, k, v, scale)
    triton_meta = build_metadata(cache, handles, context_lens, query_lens, device, use_triton=True)
    got = PagedAttention(cache, triton_meta).forward(0, q, k, v, scale)
    assert got.shape == expected.shape
    assert (got.float() - expected.float()).abs().max().item() < tol


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_sdpa_on_cpu(heads, seed):
    compare(seed, *heads, head_dim=16, page_size=4)


def test_kernel_handles_non_power_of_two_head_dim_and_big_pages():
    compare(11, 4, 2, head_dim=24, page_size=16)


def test_kernel_handles_head_dim_under_sixteen():
    # tiny models' Talker has head_dim 8; tl.dot needs K >= 16, so the block pads and masks
    compare(12, 4, 2, head_dim=8, page_size=4)


def test_tensor_only_metadata_on_a_cpu_without_the_interpreter_takes_the_reference(monkeypatch):
    # a decode graph's buffers run eagerly on a CPU (the Talker's steps when serving on a CPU)
    cache, handles, context_lens, query_lens, q, k, v = random_batch(5, 4, 2, 16, 4, "cpu", torch.float32)
    expected = PagedAttention(cache, build_metadata(cache, handles, context_lens, query_lens, "cpu",
                                                    use_triton=False)).forward(0, q, k, v, 0.25)
    meta = build_metadata(cache, handles, context_lens, query_lens, "cpu", use_triton=True)
    meta.query_lens = meta.context_lens = meta.page_tables = None
    monkeypatch.delenv("TRITON_INTERPRET")
    attention = PagedAttention(cache, meta)
    assert not attention.use_triton
    torch.testing.assert_close(attention.forward(0, q, k, v, 0.25), expected)


def long_pieces_with_padding(device, dtype, head_dim=16, page_size=4):
    """Prefill pieces longer than a query block (group 4: 16 tokens a block), starting
    anywhere in one, then a CUDA graph's padding sequence (context -1, the scratch page)."""
    torch.manual_seed(3)
    query_lens, context_lens = [37, 5, 50, 16], [3, 0, 9, 1]
    shape = KVCacheShape(1, 2, head_dim, page_size, num_pages=64)
    cache = PagedKVCache(shape, dtype, device)
    cache.keys.normal_()
    cache.values.normal_()
    for handle, (context, query) in enumerate(zip(context_lens, query_lens)):
        cache.reserve(handle, context + query)
    scratch, pad = 63, 21
    tokens = sum(query_lens) + pad
    q, k, v = (torch.randn(tokens, heads, head_dim, device=device, dtype=dtype) for heads in (8, 2, 2))
    handles = list(range(len(query_lens)))
    metas = []
    for use_triton in (False, True):
        meta = build_metadata(cache, handles, context_lens, query_lens, device, use_triton=use_triton)
        meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), scratch * page_size, device=device)])
        meta.query_lens, meta.context_lens = query_lens + [pad], context_lens + [-1]
        meta.page_tables = meta.page_tables + [[scratch] * -(-pad // page_size)]
        if use_triton:
            meta.query_start = torch.cat([meta.query_start, meta.query_start.new_tensor([tokens])])
            meta.context_lens_tensor = torch.cat([meta.context_lens_tensor, meta.context_lens_tensor.new_tensor([-1])])
            table = meta.page_table_tensor
            meta.page_table_tensor = torch.cat([table, torch.full_like(table[:1], scratch)])
            meta.max_query_len = tokens   # as a graph's bucket: its whole width
        metas.append(meta)
    return cache, metas, q, k, v, tokens - pad


def test_prefill_blocks_span_the_batch_and_padding_sequences_get_zeros():
    cache, (sdpa_meta, triton_meta), q, k, v, real = long_pieces_with_padding("cpu", torch.float32)
    expected = PagedAttention(cache, sdpa_meta).forward(0, q, k, v, 0.25)
    got = PagedAttention(cache, triton_meta).forward(0, q, k, v, 0.25)
    assert expected[real:].abs().max().item() == 0 and got[real:].abs().max().item() == 0
    assert expected[:real].abs().max().item() > 0
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.gpu
def test_prefill_blocks_span_the_batch_and_padding_sequences_get_zeros_on_cuda():
    cache, (sdpa_meta, triton_meta), q, k, v, real = long_pieces_with_padding("cuda", torch.bfloat16, head_dim=128,
                                                                             page_size=16)
    expected = PagedAttention(cache, sdpa_meta).forward(0, q, k, v, 128 ** -0.5)
    got = PagedAttention(cache, triton_meta).forward(0, q, k, v, 128 ** -0.5)
    assert got[real:].abs().max().item() == 0
    assert (got.float() - expected.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_kernel_handles_head_dim_under_sixteen_on_cuda():   # the interpreter does not check tl.dot's sizes
    compare(12, 4, 2, head_dim=8, page_size=16, device="cuda", dtype=torch.bfloat16, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)])
def test_kernel_matches_sdpa_on_cuda_bf16(seed, heads):
    compare(seed, *heads, head_dim=128, page_size=16, device="cuda", dtype=torch.bfloat16, tol=2e-2)


def compare_split_decode(seed, num_heads, num_kv_heads, head_dim, page_size, device="cpu", dtype=torch.float32,
                         tol=1e-5):
    from omniwalk.kernels import paged_attention

    cache, handles, context_lens, _, q, k, v = random_batch(seed, num_heads, num_kv_heads, head_dim, page_size,
                                                             device, dtype)
    query_lens = [1] * len(handles)
    q, k, v = q[: len(handles)], k[: len(handles)], v[: len(handles)]
    assert paged_attention.decode_splits(len(handles), num_kv_heads) >= 8
    scale = head_dim ** -0.5
    sdpa_meta = build_metadata(cache, handles, context_lens, query_lens, device, use_triton=False)
    expected = PagedAttention(cache, sdpa_meta).forward(0, q, k, v, scale)
    triton_meta = build_metadata(cache, handles, context_lens, query_lens, device, use_triton=True)
    got = PagedAttention(cache, triton_meta).forward(0, q, k, v, scale)
    assert (got.float() - expected.float()).abs().max().item() < tol


@pytest.mark.parametrize("seed", [0, 2])   # batches of 4 and 1 sequences (some contexts empty)
def test_split_decode_matches_sdpa_on_cpu(seed, monkeypatch):
    # decode batches of 1-4 sequences over 2 KV heads: split 8-16 ways, shares of 8 keys
    # (some past the end of short sequences, some sequences with no context at all)
    from omniwalk.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "SPLIT_BLOCK_N", 8)
    monkeypatch.setattr(paged_attention, "INTERPRETER_MAX_SPLITS", paged_attention.MAX_SPLITS)   # the GPU's splits
    compare_split_decode(seed, 4, 2, 16, 4)


def test_max_splits_one_decodes_unsplit(monkeypatch):
    """A caller's cap (Whisper's short windows: `max_splits=1`) leaves out the split and its
    merge kernel, where the batch's shape alone would split 8-16 ways; same values."""
    from omniwalk.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "INTERPRETER_MAX_SPLITS", paged_attention.MAX_SPLITS)
    merges = []
    monkeypatch.setattr(paged_attention, "_merge_splits_kernel", type("Merge", (), {
        "__getitem__": lambda self, grid: lambda *args, **kwargs: merges.append(grid)})())
    cache, handles, context_lens, _, q, k, v = random_batch(0, 4, 2, 16, 4, "cpu", torch.float32)
    q, k, v = q[: len(handles)], k[: len(handles)], v[: len(handles)]
    query_lens = [1] * len(handles)
    expected = PagedAttention(cache, build_metadata(cache, handles, context_lens, query_lens, "cpu",
                                                    use_triton=False)).forward(0, q, k, v, 0.25)
    got = PagedAttention(cache, build_metadata(cache, handles, context_lens, query_lens, "cpu",
                                               use_triton=True)).forward(0, q, k, v, 0.25, max_splits=1)
    assert not merges
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_split_decode_matches_sdpa_on_cuda_bf16(seed):
    compare_split_decode(seed, 32, 4, 128, 16, device="cuda", dtype=torch.bfloat16, tol=2e-2)


def test_decode_splits_are_powers_of_two_that_fill_the_gpu():
    from omniwalk.kernels.paged_attention import decode_splits

    assert [decode_splits(n, 4) for n in (1, 2, 3, 8, 32, 128)] == [16, 16, 8, 4, 1, 1]
    assert decode_splits(5, 2) == 8   # 128 // 10 = 12, rounded down
