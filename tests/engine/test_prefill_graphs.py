"""The padded layout a prefill graph replays, as its device buffers hold it.

On a CPU the padded batch runs through attention's host lists; the buffers below are what
the Triton kernels read on a GPU, so they are checked here directly.
"""

import pytest
import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.loading import EngineArgs, load_model


def test_padded_layout_in_the_device_buffers():
    loaded = load_model(EngineArgs("tiny-qwen3_5", device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=4))
    executor = loaded.served.executors["backbone"]
    pool, cache = executor.state_pool, executor.cache
    decode = DecodeGraphs(executor.model, cache, 4, 8, pool)
    graphs = PrefillGraphs(executor.model, decode, pool.shape.conv_kernel)
    handles, query_lens, context_lens = [7, 8], [5, 3], [0, 16]
    for handle, context, n in zip(handles, context_lens, query_lens):
        cache.reserve(handle, context + n)
        pool.allocate(handle)
    tables = [cache.page_tables[h] for h in handles]
    kv_slots = [s for h, c, n in zip(handles, context_lens, query_lens) for s in cache.slots(h, c, c + n)]
    logits = graphs.run(list(range(8)), [0, 1, 2, 3, 4, 16, 17, 18], kv_slots, context_lens, query_lens, tables,
                        row_slots=[pool.rows(h) for h in handles])
    assert logits.shape[0] == 2 and graphs.replays == 1
    assert graphs.bucket_for(query_lens, [len(t) for t in tables]) == (16, 4)   # 8 tokens + 2 padding sequences (1 and 7)
    longs, ints = graphs._longs, graphs._ints
    assert ints("query_start")[:5].tolist() == [0, 5, 8, 9, 16]
    assert longs("cu_seqlens")[:5].tolist() == [0, 5, 8, 9, 16]
    assert longs("ends")[:4].tolist() == [4, 7, 8, 15]
    assert ints("context_lens")[:4].tolist() == [0, 16, -1, -1]   # padding: the attention answers zeros
    scratch_kv = decode.scratch_page * cache.page_size
    assert longs("kv_slots")[:16].tolist() == kv_slots + [scratch_kv] * 8
    table = ints("page_table").view(-1, decode.max_pages)[:4]
    for row, pages in enumerate(tables):
        assert table[row, : len(pages)].tolist() == pages
        assert (table[row, len(pages):] == decode.scratch_page).all()
    assert (table[2:] == decode.scratch_page).all()
    # [read rows; write rows] per sequence, padding on the scratch slot's rows
    scratch_read, scratch_write = decode.scratch_row_slots
    assert longs("row_slots").view(2, -1)[:, :4].tolist() == [
        [pool.rows(7)[0], pool.rows(8)[0], scratch_read, scratch_read],
        [pool.rows(7)[1], pool.rows(8)[1], scratch_write, scratch_write]]
    gather = longs("conv_gather")[: 16 * pool.shape.conv_kernel].view(16, -1)
    carried = pool.shape.conv_kernel - 1
    # token 0 of sequence 0 sees its carried state then itself; the last token of the
    # second sequence sees only new tokens (it is 3 tokens in, the window reaching back 3)
    assert gather[0].tolist() == list(range(carried)) + [4 * carried]
    assert gather[7].tolist()[-1] == 4 * carried + 7
    # nothing committed: a second replay reads the same committed states
    assert torch.equal(logits, graphs.run(list(range(8)), [0, 1, 2, 3, 4, 16, 17, 18], kv_slots, context_lens,
                                          query_lens, tables, row_slots=[pool.rows(h) for h in handles]))


def test_a_128_token_prompt_fits_a_graph_except_on_a_hybrid_model():
    """Non-hybrid models have a 256-token bucket (a 128-token prompt and its padding sequence);
    a hybrid model's pieces stay within its recurrent layers' one-launch kernel (128 tokens)."""
    from omniwalk import loading
    from omniwalk.layers.gated_delta_rule import RECURRENT_PREFILL_MAX_LEN

    for model, conv in (("tiny-qwen3", False), ("tiny-qwen3_5", True)):
        loaded = load_model(EngineArgs(model, device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=4))
        executor = next(e for e in loaded.served.executors.values() if hasattr(e, "cache"))
        pool = getattr(executor, "state_pool", None)
        decode = DecodeGraphs(executor.model, executor.cache, 4, 32, pool)
        graphs = loading.capture_prefill_graphs(executor.model, decode, pool.shape.conv_kernel if conv else None)
        fits = graphs.bucket_for([128], [8])
        assert fits == (None if conv else (256, 2))
        assert max(tokens for tokens, _ in graphs.buckets) == (RECURRENT_PREFILL_MAX_LEN if conv else 256)


def test_large_buckets_follow_the_step_budget():
    """Without a family's limits the buckets go up to a step's tokens and sequences (a wave's
    prefill steps replay graphs), each rounded up to a bucket."""
    from omniwalk import loading

    loaded = load_model(EngineArgs("tiny-qwen3", device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=4))
    executor = loaded.served.executors["backbone"]
    graphs = loading.capture_prefill_graphs(executor.model, DecodeGraphs(executor.model, executor.cache, 4, 8),
                                            max_sequences=129, max_tokens=5000)
    assert max(graphs.buckets) == (6144, 256)
    assert graphs.bucket_for([96] * 63, [8] * 63) == (6144, 64)
    assert graphs.bucket_for([128] * 7, [8] * 7) == (1024, 8)


@pytest.mark.parametrize("query_lens, bucket", [
    ([4, 1, 7, 3, 4, 2, 5, 4, 6, 4], (64, 16)),   # Whisper's case: 10 pieces, 16-sequence buckets
    ([61, 40, 7, 90, 33, 52, 75, 48, 66, 70], (768, 16)),   # a long padding piece (227 tokens)
])
def test_more_pieces_than_the_default_buckets_hold_equal_the_eager_pass(query_lens, bucket):
    """A family may ask for buckets of more sequences (Whisper: an encoder pass starts up to
    16 windows' prompts in one step), and a step's budget makes them larger: 10 pieces of a
    padded bucket give the logits the eager pass gives them, each piece on its own pages."""
    from omniwalk.engine.attention import PagedAttention, build_metadata

    loaded = load_model(EngineArgs("tiny-qwen3", device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=4))
    executor = loaded.served.executors["backbone"]
    model, cache = executor.model, executor.cache
    graphs = PrefillGraphs(model, DecodeGraphs(model, cache, 4, 8), max_tokens=1024, max_sequences=16)
    assert max(seqs for _, seqs in graphs.buckets) == 16
    handles, context_lens = list(range(10, 20)), [0] * 10
    assert graphs.bucket_for(query_lens, [-(-n // cache.page_size) for n in query_lens]) == bucket
    for handle, n in zip(handles, query_lens):
        cache.reserve(handle, n)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 100, (sum(query_lens),), generator=generator).tolist()
    positions = [p for n in query_lens for p in range(n)]
    tables = [cache.page_tables[h] for h in handles]
    kv_slots = [s for h, n in zip(handles, query_lens) for s in cache.slots(h, 0, n)]
    replayed = graphs.run(input_ids, positions, kv_slots, context_lens, query_lens, tables)
    with torch.inference_mode():
        hidden = model(torch.tensor(input_ids), torch.tensor(positions),
                       PagedAttention(cache, build_metadata(cache, handles, context_lens, query_lens, cache.keys.device)))
        eager = model.compute_logits(hidden[torch.tensor(query_lens).cumsum(0) - 1])
    assert replayed.shape == eager.shape == (10, eager.shape[1]) and graphs.replays == 1
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
