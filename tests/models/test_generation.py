"""End to end through `omniwalk.Engine`: the budget contract, HF `generate` parity,
batching invariance, preemption and cancellation, for the text families."""

from __future__ import annotations

import dataclasses
import gc
import random
import time
from pathlib import Path

import pytest
import torch
import transformers

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.engine.causal_lm_executor import CausalLMExecutor
from omniwalk.engine_loop import EngineLoop
from omniwalk.tokenizer import encode

TOKENIZER_DIR = Path(__file__).parents[2] / "omniwalk" / "models" / "assets" / "tiny-tokenizer"
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3"]


@pytest.fixture(scope="module", params=["tiny-qwen3", pytest.param("tiny-llama", marks=pytest.mark.slow)])
def engine(request):
    with Engine(EngineArgs(request.param, max_num_batched_tokens=64)) as engine:
        yield engine


def greedy(max_tokens, **kw):
    return dict(max_tokens=max_tokens, temperature=0.0, **kw)


# ---------------------------------------------------------------- budget contract

@pytest.mark.parametrize("n", [1, 2, 3, 64])
def test_exactly_n_tokens_with_ignore_eos(engine, n):
    before = dict(engine.stats.walk_counts)
    [result] = engine.generate(["Hello there"], **greedy(n, ignore_eos=True))
    assert len(result.token_ids) == n and result.usage.output_tokens == n
    assert result.finish_reason == "length"
    streamed = list(engine.stream("Hello there", **greedy(n, ignore_eos=True)))
    assert [t for c in streamed for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in streamed) == result.text
    assert streamed[-1].finished and streamed[-1].usage.output_tokens == n
    decodes = engine.stats.walk_counts.get("decode", 0) - before.get("decode", 0)
    prefills = engine.stats.walk_counts.get("prefill", 0) - before.get("prefill", 0)
    assert prefills == 2
    assert decodes == (0 if n == 1 else 2)   # N = 1 ends at its prefill: no decode walk at all


def test_eos_the_model_emits_stops_and_counts(engine):
    [free] = engine.generate(["Hello there"], **greedy(12, ignore_eos=True))
    eos = free.token_ids[3]
    first = free.token_ids.index(eos)
    loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset({eos}))
    with Engine(engine.args, loaded=loaded) as with_eos:
        for stream in (False, True):
            if stream:
                chunks = list(with_eos.stream("Hello there", **greedy(12)))
                ids = [t for c in chunks for t in c.token_ids]
                final = chunks[-1]
            else:
                final = with_eos.generate(["Hello there"], **greedy(12))[0]
                ids = final.token_ids
            assert ids == free.token_ids[: first + 1]          # ends at the EOS, EOS included
            assert final.finish_reason == "stop"
            assert final.usage.output_tokens == first + 1
        # ignore_eos overrides the EOS; min_tokens suppresses it (as HF/vLLM)
        [ignored] = with_eos.generate(["Hello there"], **greedy(12, ignore_eos=True))
        assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"
        [late] = with_eos.generate(["Hello there"], **greedy(12, min_tokens=first + 2))
        assert len(late.token_ids) >= first + 2 and eos not in late.token_ids[: first + 2]


def test_stop_token_ids_and_stop_strings(engine):
    [free] = engine.generate(["Hello there"], **greedy(10, ignore_eos=True))
    stop_id = free.token_ids[2]
    [stopped] = engine.generate(["Hello there"], **greedy(10, stop_token_ids=[stop_id], ignore_eos=True))
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop"
    # a stop string: text ends before it, ids end at the token that completed it
    text = free.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    [by_string] = engine.generate(["Hello there"], **greedy(10, stop=[needle], ignore_eos=True))
    assert by_string.finish_reason == "stop"
    assert by_string.text == text[: text.index(needle)]
    assert by_string.token_ids == free.token_ids[: len(by_string.token_ids)]
    streamed = list(engine.stream("Hello there", **greedy(10, stop=[needle], ignore_eos=True)))
    assert "".join(c.text for c in streamed) == by_string.text
    assert [t for c in streamed for t in c.token_ids] == by_string.token_ids


# ---------------------------------------------------------------- batching

@pytest.mark.slow
def test_batch_of_16_equals_each_alone(engine):
    rng = random.Random(7)
    requests = []
    for i in range(16):
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "fox", "cat"]) for _ in range(rng.randint(1, 40)))
        requests.append(GenerationRequest(prompt=words, max_tokens=rng.randint(1, 40), ignore_eos=True,
                                          sampling=SamplingParams(temperature=0.0)))
    together = engine.generate(requests)
    for request, result in zip(requests, together):
        [alone] = engine.generate([request])
        assert alone.token_ids == result.token_ids
        assert len(result.token_ids) == request.max_tokens


def test_seeded_sampling_same_alone_and_in_batch(engine):
    seeded = GenerationRequest(prompt="Tell me a story", max_tokens=24, ignore_eos=True,
                               sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=1234))
    [alone] = engine.generate([seeded])
    others = [GenerationRequest(prompt=f"noise {i}", max_tokens=30, ignore_eos=True,
                                sampling=SamplingParams(temperature=1.0, seed=i)) for i in range(7)]
    batch = engine.generate(others[:3] + [seeded] + others[3:])
    assert batch[3].token_ids == alone.token_ids
    [other_seed] = engine.generate([dataclasses.replace(seeded, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=99))])
    assert other_seed.token_ids != alone.token_ids


# ---------------------------------------------------------------- resources

def test_preemption_under_a_tiny_kv_cache_keeps_outputs(engine):
    prompts = [f"request number {i} with some words" for i in range(8)]
    expected = engine.generate(prompts, **greedy(40, ignore_eos=True))
    small = EngineArgs(engine.args.model, kv_cache_tokens=160, page_size=8, max_num_batched_tokens=32)
    with Engine(small) as tight:
        results = tight.generate(prompts, **greedy(40, ignore_eos=True))
        assert tight.stats.num_preemptions > 0
        assert tight.model.cache.allocator.num_free == tight.model.cache.allocator.num_pages
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


def test_cancel_mid_decode_frees_every_page(engine):
    allocator = engine.model.cache.allocator
    free_before = allocator.num_free
    budget = 500
    streams = [engine.stream(f"cancel me {i}", **greedy(budget, ignore_eos=True)) for i in range(4)]
    iterator = iter(streams[0])
    first = [next(iterator), next(iterator)]       # it is decoding now
    assert allocator.num_free < free_before
    for stream in streams:
        stream.abort()
    # every stream was cut short: its final chunk says abort, and it got fewer than its budget
    for chunks in [first + list(iterator)] + [list(stream) for stream in streams[1:]]:
        final, received = chunks[-1], sum(len(chunk.token_ids) for chunk in chunks)
        assert final.finished and final.finish_reason == "abort"
        assert received == final.usage.output_tokens < budget
    deadline = time.monotonic() + 10
    while (engine.num_in_flight or engine.stats.num_running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert allocator.num_free == free_before
    assert not engine.model.executors["backbone"].sequences


def test_bad_inputs_are_value_errors(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([""])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 2, 10**6]])
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate(["hi"], max_tokens=0)
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.generate(["hi"], max_tokens=engine.max_model_len)
    with pytest.raises(ValueError, match="cannot be tokenized"):
        engine.generate(["lone surrogate \ud800"])
    with pytest.raises(ValueError, match="min_tokens"):
        engine.generate(["hi"], max_tokens=None, min_tokens=engine.max_model_len)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate(["hi"], stop_token_ids=[-1])
    assert engine.generate(["hi"], max_tokens=2)[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("text", ["The quick brown fox.", "naïve café, 日本語, 🙂 and\ttabs\n  ",
                                  "<|im_start|>user\nhi<|im_end|>", " leading space", ""])
def test_encode_is_the_tokenizers_encode(engine, text):
    """`omniwalk.tokenizer.encode` calls a fast tokenizer's backend directly: the same ids as transformers'
    encode with special tokens (BOS where the tokenizer adds one)."""
    assert encode(engine.tokenizer, text) == engine.tokenizer.encode(text, add_special_tokens=True)


def test_submit_after_shutdown_is_refused():
    engine = Engine(EngineArgs("tiny-qwen3"))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(["hi"])


def test_a_running_engine_collects_young_objects_rarely_and_restores_the_collector():
    before = gc.get_threshold()
    with Engine(EngineArgs("tiny-qwen3")) as engine:
        assert gc.get_threshold()[0] == max(before[0], Engine.GC_YOUNG_THRESHOLD)
        assert gc.get_freeze_count() > 0
        assert len(engine.generate(["hi"], max_tokens=3)[0].token_ids) == 3
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_burst_arriving_at_an_idle_engine_is_prefilled_together():
    """Requests submitted ~1 ms apart to an idle engine: it waits while they keep coming
    (the burst window) and prefills them in one step, instead of the first one alone."""
    with Engine(EngineArgs("tiny-qwen3", burst_window_ms=20)) as engine:
        streams = []
        for i in range(8):
            streams.append(engine.submit(GenerationRequest(prompt=f"request {i}", max_tokens=1)))
            time.sleep(0.001)
        assert all(len(list(stream)) >= 1 for stream in streams)
        assert engine.stats.node_batches.get("backbone", 0) == 1   # max_tokens=1: each ends at its prefill


@pytest.mark.parametrize("window", [-1, 101])
def test_burst_window_is_validated(window):
    with pytest.raises(ValueError, match="burst_window_ms"):
        EngineArgs(burst_window_ms=window)


# ---------------------------------------------------------------- HF parity

HF_FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
}


@pytest.fixture(scope="module", params=list(HF_FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    config_cls, model_cls, extra = HF_FAMILIES[request.param]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=0, initializer_range=0.3, tie_word_embeddings=request.param == "qwen3",
        attn_implementation="eager", **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config).eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


def test_greedy_ids_and_logprobs_equal_hf_generate(hf_checkpoint):
    folder, hf_model, tokenizer = hf_checkpoint
    with Engine(EngineArgs(str(folder), dtype="float32", device="cpu", max_num_batched_tokens=16)) as engine:
        requests = [GenerationRequest(prompt=p, max_tokens=64, sampling=SamplingParams(temperature=0.0, logprobs=1))
                    for p in PROMPTS]
        results = engine.generate(requests)
    for prompt, result in zip(PROMPTS, results):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = hf_model.generate(ids, max_new_tokens=64, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        expected = out.sequences[0, ids.shape[1]:].tolist()
        assert result.token_ids == expected
        assert len(set(expected)) > 3     # the check means something: not one repeated token
        hf_logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
        ours = torch.tensor([lp.logprob for lp in result.logprobs])
        chosen = hf_logprobs[torch.arange(len(expected)), torch.tensor(expected)]
        assert torch.allclose(ours, chosen, atol=1e-4)


def test_penalties_apply_and_are_batch_invariant(engine):
    plain = GenerationRequest(prompt="the the the", max_tokens=24, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.0))
    penalized = dataclasses.replace(plain, sampling=SamplingParams(temperature=0.0, repetition_penalty=1.8,
                                                                   frequency_penalty=1.0))
    [free] = engine.generate([plain])
    [alone] = engine.generate([penalized])
    assert alone.token_ids != free.token_ids      # the penalties change what greedy picks
    # the same row in a batch with other penalized and plain rows gives the same ids
    others = [dataclasses.replace(penalized, prompt=f"other {i}") for i in range(3)] + [plain]
    batch = engine.generate(others[:2] + [penalized] + others[2:])
    assert batch[2].token_ids == alone.token_ids
    # a repetition penalty > 1 makes a greedy row repeat less than without it
    assert len(set(alone.token_ids)) >= len(set(free.token_ids))


def test_chunked_prefill_gives_identical_outputs():
    """Prompts split into 8-token chunks across steps (mixed with other requests' decode
    steps) give the ids of prompts computed in one piece."""
    prompts = [" ".join(["word"] * n) + f" end {n}" for n in (5, 40, 90, 130)]
    runs = {}
    for budget in (8, 4096):
        with Engine(EngineArgs("tiny-qwen3", max_num_batched_tokens=budget, enable_prefix_caching=False)) as engine:
            runs[budget] = [r.token_ids for r in engine.generate(prompts, max_tokens=20, ignore_eos=True)]
            batches = engine.stats.node_batches.get("backbone", 0)
        if budget == 8:
            assert batches > 20 + 130 // 8      # the long prompts really took several steps
    assert runs[8] == runs[4096]


@pytest.mark.parametrize("model", ["tiny-qwen3", pytest.param("tiny-qwen3_5", marks=pytest.mark.slow)])
def test_startup_warmup_leaves_no_trace(record_batch_sizes, model):
    """The warm-up requests (on by default on CUDA) run before serving: afterwards nothing
    runs or waits, every KV page (and recurrent-state slot) is free again, the counters are
    clean, and a seeded sampled request gives what it gives on an engine that did not warm up."""
    request = dict(max_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    outputs, batches = {}, record_batch_sizes(CausalLMExecutor)
    for warmup in (False, True):
        batches.clear()
        with Engine(EngineArgs(model, startup_warmup=warmup, max_num_batched_tokens=128)) as engine:
            assert (max(batches, default=0) == 8) == warmup   # eight requests ran, together
            runtime, cache = engine.runtime, engine.model.cache
            assert not runtime.running and not runtime.waiting and not runtime.walk_counts
            assert cache.allocator.num_free == cache.allocator.num_pages and not cache.page_tables
            pool = getattr(runtime.executors["backbone"], "state_pool", None)
            assert pool is None or pool.num_free == pool.num_slots
            outputs[warmup] = engine.generate(["The quick brown fox"], **request)[0].token_ids
    assert len(outputs[True]) == 12 and outputs[True] == outputs[False]


def test_startup_warmup_is_on_by_default_only_on_cuda(monkeypatch):
    ran = []
    monkeypatch.setattr(EngineLoop, "warm_up", lambda self, requests: ran.append(len(requests)))
    with Engine(EngineArgs("tiny-qwen3")):
        pass
    assert ran == []   # CPU
    with Engine(EngineArgs("tiny-qwen3", startup_warmup=True)):
        pass
    assert ran == [8]


def test_an_engine_going_idle_collects_the_young_generations_there(monkeypatch):
    """After steps, an idle loop runs the collector's young and middle generations itself,
    so the pause falls between bursts rather than at the threshold inside the next one."""
    collected = []
    real_collect = gc.collect
    with Engine(EngineArgs("tiny-qwen3")) as engine:
        monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or real_collect(generation))
        time.sleep(0.05)
        assert collected == []   # idle since it started: nothing to collect for
        assert len(engine.generate(["hi"], max_tokens=3)[0].token_ids) == 3
        deadline = time.monotonic() + 5
        while not collected and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
    assert collected == [1]   # once per idle period, not once per idle wake-up


def test_startup_warmup_fits_a_small_queue():
    with Engine(EngineArgs("tiny-qwen3", startup_warmup=True, max_num_seqs=1, max_queue=1)) as engine:
        assert len(engine.generate(["hi"], max_tokens=2)[0].token_ids) == 2


def test_startup_warm_up_ends_with_greedy_rows_alone():
    """The text warm-up (on CUDA at start; asked for here on a CPU) runs to the end, and its
    last steps are greedy rows alone: a greedy client's sampling plan is compiled at load."""
    from omniwalk.models.decoder_lm.model import TEXT_STREAM

    engine = Engine(EngineArgs("tiny-qwen3", device="cpu", dtype="float32", startup_warmup=True))
    try:
        requests = engine.loaded.warmup_requests()
        budgets = [(r.streams[TEXT_STREAM].sampling.temperature, r.streams[TEXT_STREAM].max_items)
                   for r in requests]
        greedy = [n for t, n in budgets if t == 0.0]
        assert len(greedy) == 1 and len(budgets) > 1
        assert greedy[0] > max(n for t, n in budgets if t > 0.0)
        assert engine.generate([[5, 6, 7]], max_tokens=3)[0].token_ids   # served after it
    finally:
        engine.shutdown()
