"""Prefix caching: shared prompt prefixes are computed once, and outputs do not change."""

import random

import pytest

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.engine.kv_cache import KVCacheShape, PagedKVCache
from omniwalk.loading import load_model


def test_pages_are_shared_refcounted_and_evicted_last_freed_first():
    cache = PagedKVCache(KVCacheShape(1, 1, 4, page_size=4, num_pages=6), dtype=__import__("torch").float32,
                         device="cpu", enable_prefix_caching=True)
    prompt = list(range(10))                       # pages [0-3] [4-7] and 2 more tokens
    assert cache.match_prefix(0, prompt) == 0
    cache.reserve(0, 10)
    cache.register_full_pages(0, prompt, 10)
    first_pages = list(cache.page_tables[0])
    # a second prompt with the same 8-token prefix shares both full pages
    assert cache.match_prefix(1, prompt[:8] + [99, 98, 97]) == 8
    assert cache.page_tables[1] == first_pages[:2]
    # a prompt that is exactly the cached pages leaves its last token to compute
    assert cache.match_prefix(2, prompt[:8]) == 4
    cache.free(0), cache.free(1), cache.free(2)
    assert cache.allocator.num_free == 6           # evictable pages count as free
    assert len(cache.allocator.evictable) == 2
    # allocating everything evicts the cached pages, and they are then forgotten
    cache.reserve(3, 24)
    assert not cache.cached_pages and cache.match_prefix(4, prompt) == 0


@pytest.mark.parametrize("model", ["tiny-qwen3", pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_outputs_identical_with_prefix_caching_on_and_off(model):
    rng = random.Random(3)
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    requests = [
        GenerationRequest(prompt=system + f"Question {i}: " + " ".join(rng.choice(["cat", "dog", "fox"]) for _ in range(i + 1)),
                          max_tokens=12 + i, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i))
        for i in range(8)
    ]
    outputs = {}
    for enabled in (False, True):
        args = EngineArgs(model, enable_prefix_caching=enabled, page_size=8, max_num_batched_tokens=64)
        with Engine(args) as engine:
            first = engine.generate(requests[:1])          # fills the cache with the shared prefix
            rest = engine.generate(requests[1:])
            outputs[enabled] = [r.token_ids for r in first + rest]
            cache = engine.model.cache
            assert (cache.num_cached_tokens_hit > 0) == enabled
            assert cache.allocator.num_free == cache.allocator.num_pages
    assert outputs[True] == outputs[False]


@pytest.mark.slow
def test_prefix_caching_under_preemption_keeps_outputs():
    prompts = [("shared words " * 6) + f"tail {i}" for i in range(6)]
    results = {}
    for kv_tokens in (None, 200):
        args = EngineArgs("tiny-qwen3", kv_cache_tokens=kv_tokens, page_size=8, max_num_batched_tokens=32)
        with Engine(args) as engine:
            results[kv_tokens] = [r.token_ids for r in engine.generate(prompts, max_tokens=30, ignore_eos=True)]
            if kv_tokens:
                assert engine.stats.num_preemptions > 0
            assert engine.model.cache.allocator.num_free == engine.model.cache.allocator.num_pages
    assert results[None] == results[200]


@pytest.mark.parametrize("model,shares_prefixes", [("tiny-qwen3", True), ("tiny-llama", True),
                                                    ("tiny-orpheus", True), ("tiny-qwen3_5", False),
                                                    ("tiny-whisper", False)])
def test_every_family_takes_prefix_caching_from_the_shared_pipeline(model, shares_prefixes):
    """On by default where a family can share prefixes (hybrid and cross-attention models
    cannot: their keys or state depend on more than the prompt), off with --no-prefix-caching."""
    assert load_model(EngineArgs(model)).served.cache.enable_prefix_caching == shares_prefixes
    assert not load_model(EngineArgs(model, enable_prefix_caching=False)).served.cache.enable_prefix_caching


def test_orpheus_hits_the_prefix_cache_for_a_shared_voice_prompt():
    from omniwalk import SpeechRequest, synthesize

    # a long common start of the framed prompt ("tara: " and the text), so whole pages match
    text = "The same long sentence, spoken twice by the same voice, fills more than one page. " * 2
    with Engine(EngineArgs("tiny-orpheus", page_size=4)) as engine:
        first = synthesize(engine, SpeechRequest(text, max_output_tokens=14, seed=1, ignore_eos=True))
        assert engine.model.cache.num_cached_tokens_hit == 0
        second = synthesize(engine, SpeechRequest(text, max_output_tokens=14, seed=1, ignore_eos=True))
        assert engine.model.cache.num_cached_tokens_hit > 0
        assert second.pcm == first.pcm and second.token_ids == first.token_ids   # the hit changes nothing
