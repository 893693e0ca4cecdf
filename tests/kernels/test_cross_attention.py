"""The Triton cross-attention decode kernel against its torch reference (gather + SDPA).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton compiles anything here

pytest.importorskip("triton")

from omniwalk.engine import cross_attention  # noqa: E402
from omniwalk.engine.cross_attention import CrossAttention, CrossAttentionCache, CrossAttentionShape  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_attention_decode_kernel_matches_sdpa(monkeypatch, dtype):
    """Whisper's cross-attention decode step read in place from the slot pool (the CUDA
    kernel, in the interpreter here) against the gather + SDPA path."""
    gen = torch.Generator().manual_seed(5)
    cache = CrossAttentionCache(CrossAttentionShape(num_layers=2, num_slots=5, source_len=150, num_heads=3,
                                                    head_dim=20), dtype, "cpu")
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    for handle in (10, 11, 12, 13):
        cache.allocate(handle)
    handles = [13, 10, 12]                          # slots out of order
    query = torch.randn(3, 3, 20, generator=gen).to(dtype)
    expected = CrossAttention(cache, handles, [1, 1, 1]).forward(1, query, 0.3)
    monkeypatch.setattr(cross_attention, "use_triton", lambda x: True)
    got = CrossAttention(cache, handles, [1, 1, 1]).forward(1, query, 0.3)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)


def filled_cache(gen, shape, handles) -> CrossAttentionCache:
    """A float32 pool of random keys/values with a slot allocated to each handle."""
    cache = CrossAttentionCache(shape, torch.float32, "cpu")
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    for handle in handles:
        cache.allocate(handle)
    return cache


def test_ragged_prefill_reads_each_tokens_slot_in_place(monkeypatch):
    """A batch mixing decode rows with new prompts (query lengths 1, 3, 2): on CUDA every
    token is a row of the decode kernel naming its stream's slot; the same as one SDPA per stream."""
    gen = torch.Generator().manual_seed(6)
    cache = filled_cache(gen, CrossAttentionShape(num_layers=2, num_slots=4, source_len=90, num_heads=2, head_dim=16),
                         handles=(20, 21, 22))
    handles, query_lens = [22, 20, 21], [1, 3, 2]
    query = torch.randn(6, 2, 16, generator=gen)
    expected = CrossAttention(cache, handles, query_lens).forward(1, query, 0.25)
    monkeypatch.setattr(cross_attention, "use_triton", lambda x: True)
    view = CrossAttention(cache, handles, query_lens)
    assert view.token_slot_index.tolist() == [cache.slot_of[22]] + [cache.slot_of[20]] * 3 + [cache.slot_of[21]] * 2
    torch.testing.assert_close(view.forward(1, query, 0.25), expected, atol=1e-5, rtol=1e-5)


def test_prefill_graph_view_gathers_each_tokens_slot_from_the_layout(monkeypatch):
    """A prefill graph's view holds no host lengths on CUDA: each token's slot comes from the
    layout's cu_seqlens and the sequences' slots (padding sequence last, on the scratch slot)."""
    from omniwalk.engine.ragged import RaggedLengths

    gen = torch.Generator().manual_seed(8)
    cache = filled_cache(gen, CrossAttentionShape(num_layers=1, num_slots=5, source_len=70, num_heads=2, head_dim=16),
                         handles=(30, 31, 32))
    handles, lengths = [32, 30, 31], [4, 1, 3]          # the last: a padding sequence on handle 31's slot
    query = torch.randn(8, 2, 16, generator=gen)
    expected = CrossAttention(cache, handles, lengths).forward(0, query, 0.25)
    slots = torch.tensor([cache.slot_of[h] for h in handles])
    cu_seqlens = torch.tensor([0, 4, 5, 8])
    ragged = RaggedLengths.from_buffers(cu_seqlens, torch.zeros(8, 1, dtype=torch.long),
                                        torch.zeros(3, 0, dtype=torch.long), max_len=8)   # as on CUDA: no lengths
    monkeypatch.setattr(cross_attention, "use_triton", lambda x: True)
    view = cache.prefill_view(slots[None], ragged)
    got = view.forward(0, query, 0.25)
    assert view.token_slot_index.tolist() == [slots[0]] * 4 + [slots[1]] + [slots[2]] * 3
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def random_pool(gen, num_slots, source_len, heads, head_dim, dtype, device="cpu"):
    keys = torch.randn(num_slots, source_len, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    values = torch.randn(num_slots, source_len, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 16])
def test_split_cross_attention_decode_matches_reference(dtype, splits):
    """Each row's positions split `splits` ways, partials merged. 150 positions: no multiple
    of the 32-position tile and under splits * 32, so past 4 ways some shares are empty
    (16 ways: shares of 32, 5 with positions, 11 past the end)."""
    from omniwalk.kernels.cross_attention import cross_attention_decode, cross_attention_reference

    gen = torch.Generator().manual_seed(7 + splits)
    keys, values = random_pool(gen, num_slots=5, source_len=150, heads=3, head_dim=20, dtype=dtype)
    slot_index = torch.tensor([3, 0, 4, 1])          # several rows, each its own slot, out of order
    query = torch.randn(4, 3, 20, generator=gen).to(dtype)
    expected = cross_attention_reference(query, keys, values, slot_index, 0.3)
    got = cross_attention_decode(query, keys, values, slot_index, 0.3, splits=splits)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)


def test_split_kernel_through_the_decode_view_with_the_gpus_splits(monkeypatch):
    """The decode step as the model calls it, split as the GPU would split it (3 rows x 3 heads: 16 ways)."""
    from omniwalk.kernels import cross_attention as kernel

    monkeypatch.setattr(kernel, "INTERPRETER_MAX_SPLITS", kernel.MAX_SPLITS)
    assert kernel.cross_attention_splits(3, 3, on_gpu=False) == 16
    gen = torch.Generator().manual_seed(9)
    cache = CrossAttentionCache(CrossAttentionShape(num_layers=1, num_slots=4, source_len=97, num_heads=3,
                                                    head_dim=16), torch.float32, "cpu")
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    for handle in (1, 2, 3):
        cache.allocate(handle)
    handles = [3, 1, 2]
    query = torch.randn(3, 3, 16, generator=gen)
    expected = CrossAttention(cache, handles, [1, 1, 1]).forward(0, query, 0.25)
    monkeypatch.setattr(cross_attention, "use_triton", lambda x: True)
    got = CrossAttention.for_decode_graph(cache, CrossAttention(cache, handles, [1, 1, 1]).slot_index).forward(
        0, query, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_cross_attention_splits_fill_the_gpu_and_stay_unsplit_in_the_interpreter():
    from omniwalk.kernels.cross_attention import cross_attention_splits

    # whisper-large-v3: 20 heads
    assert [cross_attention_splits(rows, 20) for rows in (1, 2, 4, 8, 16, 32, 64)] == [16, 8, 4, 2, 1, 1, 1]
    for rows in range(1, 65):
        splits = cross_attention_splits(rows, 20)
        assert splits & (splits - 1) == 0
        assert rows * 20 * splits > 256 or splits == 16   # 132 SMs about twice over, at least
    assert cross_attention_splits(1, 20, on_gpu=False) == 1   # CI's interpreter: unsplit


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_split_cross_attention_decode_on_cuda_bf16(rows, splits):
    """whisper-large-v3's shape (1500 positions, 20 heads, head_dim 64) on the GPU, split as
    the shape chooses (16, 2, 1 ways) and 3 ways."""
    from omniwalk.kernels.cross_attention import cross_attention_decode, cross_attention_reference

    gen = torch.Generator().manual_seed(rows)
    keys, values = random_pool(gen, num_slots=rows + 2, source_len=1500, heads=20, head_dim=64,
                               dtype=torch.bfloat16, device="cuda")
    slot_index = torch.randperm(rows + 2, generator=gen)[:rows].cuda()
    query = torch.randn(rows, 20, 64, generator=gen).to("cuda", torch.bfloat16)
    expected = cross_attention_reference(query, keys, values, slot_index, 0.125)
    got = cross_attention_decode(query, keys, values, slot_index, 0.125, splits=splits)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
