"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) against transformers, and its
recurrent-state resource in the engine.

Kernels against transformers' torch fallbacks; the model on a ragged batch against one
full pass; then end to end through `omniwalk.Engine` on a tiny random checkpoint written
by `save_pretrained`: greedy ids and logprobs equal `generate`'s, chunked prefill, batch
invariance, the budget contract, cancellation and preemption (slots and pages all back).
All CPU fp32.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.engine.attention import PagedAttention, attention_for_tests, build_metadata
from omniwalk.engine.kv_cache import KVCacheShape, PagedKVCache
from omniwalk.engine.state_pool import StateBatch, StatePool, StatePoolShape
from omniwalk.kernels.causal_conv import causal_conv1d
from omniwalk.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from omniwalk.models import qwen3_5
from omniwalk.models.loader import init_random_weights, load_checkpoint_weights, read_hf_config
from omniwalk.models.qwen3_5.loading import checkpoint_name, state_pool_shape
from omniwalk.models.qwen3_5.model import Qwen3_5ForCausalLM

TOKENIZER_DIR = Path(__file__).parents[2] / "omniwalk" / "models" / "assets" / "tiny-tokenizer"
TOL = 1e-4
# long enough to cross the 64-token chunk of the chunked delta rule
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Once upon a time, in a land far away, there lived a king. " * 6,
    "1 2 3 4 5 6 7 8 9 10 " * 9,
]
TEXT_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
    layer_types=["linear_attention"] * 3 + ["full_attention"], bos_token_id=None, eos_token_id=0,
    initializer_range=0.1,
)


def perturb_norms(model: torch.nn.Module) -> None:
    """HF initializes the `1 + weight` norms to zero and the gated norm to one: move them
    off those values so their parameters (and names) are really checked."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 1.0 if ".linear_attn.norm." in name else 0.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory, tokenizer):
    """(folder, HF model): a tiny random Qwen3_5ForCausalLM written with save_pretrained."""
    config = transformers.Qwen3_5TextConfig(**TEXT_CONFIG, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    perturb_norms(model)
    folder = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    with Engine(EngineArgs(str(hf_checkpoint[0]), device="cpu", dtype="float32")) as engine:
        yield engine


def greedy(max_tokens, **kw):
    return dict(max_tokens=max_tokens, temperature=0.0, **kw)


def state_pool(engine: Engine) -> StatePool:
    return engine.model.executors["backbone"].state_pool


# ---------------------------------------------------------------- kernels

def random_delta_rule_inputs(seq_len: int, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    key_heads, value_heads, key_dim, value_dim = 2, 4, 16, 8
    q = torch.randn(batch, seq_len, key_heads, key_dim, generator=g)
    k = torch.randn(batch, seq_len, key_heads, key_dim, generator=g)
    v = torch.randn(batch, seq_len, value_heads, value_dim, generator=g)
    decay = -3 * torch.rand(batch, seq_len, value_heads, generator=g)
    beta = torch.rand(batch, seq_len, value_heads, generator=g)
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=g)
    return q, k, v, decay, beta, state


def test_chunked_and_recurrent_delta_rule_agree_with_each_other_and_hf():
    q, k, v, g, beta, state = random_delta_rule_inputs(150)   # 2 full chunks and a partial one
    chunked, chunked_state = chunk_gated_delta_rule(q, k, v, g, beta, state)
    stepped, stepped_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_chunked, hf_chunked_state = hf_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    hf_stepped, hf_stepped_state = hf_qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    for out, final in ((stepped, stepped_state), (hf_chunked, hf_chunked_state), (hf_stepped, hf_stepped_state)):
        assert (chunked - out).abs().max() < 1e-5 and (chunked_state - final).abs().max() < 1e-5
    assert chunked.shape == v.shape and chunked_state.dtype == torch.float32


@pytest.mark.parametrize("split", [1, 37, 64, 100])
def test_delta_rule_state_carries_across_pieces(split):
    """Prefill in two pieces (the second may be a single decode step) == one pass."""
    q, k, v, g, beta, state = random_delta_rule_inputs(101, seed=split)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, state)
    first, mid_state = chunk_gated_delta_rule(*(x[:, :split] for x in (q, k, v, g, beta)), state, chunk_size=16)
    rule = recurrent_gated_delta_rule if 101 - split == 1 else chunk_gated_delta_rule
    second, final_state = rule(*(x[:, split:] for x in (q, k, v, g, beta)), mid_state)
    assert (torch.cat([first, second], dim=1) - whole).abs().max() < 1e-5
    assert (final_state - whole_state).abs().max() < 1e-5


def test_causal_conv_with_state_matches_hf():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 30, 12, generator=g)            # [batch, seq_len, channels]
    weight = torch.randn(12, 4, generator=g)
    expected = hf_qwen3_5.causal_conv1d_fn(x.transpose(1, 2), weight, activation="silu").transpose(1, 2)
    state = torch.zeros(2, 12, 3)
    pieces = []
    for start, end in ((0, 2), (2, 3), (3, 17), (17, 30)):   # a piece shorter than the state, a decode step
        out, state = causal_conv1d(x[:, start:end], weight, state)
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces, dim=1), expected, atol=1e-6)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))


# ---------------------------------------------------------------- state pool

def tiny_pool(num_slots: int = 3) -> StatePool:
    shape = StatePoolShape(num_layers=2, conv_dim=6, conv_kernel=4, num_heads=2, key_dim=3, value_dim=5,
                           num_slots=num_slots)
    return StatePool(shape, torch.float32, "cpu")


def test_state_pool_check_then_act_and_fresh_slots_are_empty():
    pool = tiny_pool(2)
    assert pool.can_allocate() and pool.num_free == 2
    first = pool.allocate(10)
    pool.conv[:, 2 * first : 2 * first + 2] = 1.0      # both rows: the committed one and the next
    pool.recurrent[:, 2 * first : 2 * first + 2] = 2.0
    pool.commit([10])
    pool.allocate(11)
    assert not pool.can_allocate() and pool.holds(10) and pool.holds(11)
    with pytest.raises(RuntimeError):
        pool.allocate(12)
    with pytest.raises(RuntimeError):
        pool.allocate(11)
    pool.free(10)
    pool.free(10)          # freeing twice is harmless
    assert pool.num_free == 1 and not pool.holds(10)
    again = pool.allocate(12)
    assert again == first                                    # reused, and handed out empty
    assert pool.rows(12) == (2 * again, 2 * again + 1)       # parity reset
    assert not pool.conv[:, 2 * again : 2 * again + 2].any() and not pool.recurrent[:, 2 * again : 2 * again + 2].any()


def test_state_rows_flip_only_on_commit():
    """A pass writes the row beside the committed one; commit makes it the committed one,
    for the handles committed only."""
    pool = tiny_pool()
    for h in (5, 6):
        pool.allocate(h)
    (read5, write5), (read6, write6) = pool.rows(5), pool.rows(6)
    assert read5 // 2 == write5 // 2 and read5 != write5 and {read5, write5}.isdisjoint({read6, write6})
    batch = StateBatch(pool, [pool.rows(6), pool.rows(5)], query_lens=[1, 4])
    assert not batch.all_decode and batch.ragged.cu_seqlens.tolist() == [0, 1, 5]
    rows = batch.recurrent(1)
    assert rows.read.tolist() == [read6, read5] and rows.write.tolist() == [write6, write5]
    rows.scatter(rows.gather() + 2)
    conv = batch.conv(1)
    assert conv.gather().shape == (2, 6, 3)
    conv.scatter(conv.gather() + 1)
    assert (pool.recurrent[1, [write5, write6]] == 2).all() and not pool.recurrent[1, [read5, read6]].any()
    assert (pool.conv[1, [write5, write6]] == 1).all() and not pool.conv[0].any()
    pool.commit([5])                                          # 6's step was dropped
    assert pool.rows(5) == (write5, read5) and pool.rows(6) == (read6, write6)
    pool.commit([5])
    assert pool.rows(5) == (read5, write5)


def test_graph_state_batch_uses_the_rows_its_buffer_holds_at_each_use():
    """A CUDA graph's StateBatch: the rows are whatever the static buffer holds when the
    graph replays."""
    pool = tiny_pool(4)
    for h in (1, 2, 3):
        pool.allocate(h)
    buffer = torch.tensor([pool.rows(1), pool.rows(2)]).T.contiguous()    # [read; write] x rows
    batch = StateBatch.for_graph(pool, buffer)
    assert batch.all_decode
    buffer[:, 1] = torch.tensor(pool.rows(3))      # the executor refills the buffer before a replay
    rows = batch.recurrent(0)
    assert rows.read.tolist() == [pool.rows(1)[0], pool.rows(3)[0]]
    assert rows.write.tolist() == [pool.rows(1)[1], pool.rows(3)[1]]


# ---------------------------------------------------------------- the model

def load_ours(folder) -> Qwen3_5ForCausalLM:
    model = Qwen3_5ForCausalLM(qwen3_5.config_from_hf(read_hf_config(folder))).eval()
    load_checkpoint_weights(model, folder, rename=checkpoint_name)
    return model


def full_forward(model: Qwen3_5ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    config = model.config
    pool = StatePool(state_pool_shape(config, 1), torch.float32, "cpu")
    attention = attention_for_tests(len(config.full_attention_layers), config.num_kv_heads, config.head_dim, len(ids))
    pool.allocate(0)
    hidden = model(ids, torch.arange(len(ids)), attention, StateBatch(pool, [pool.rows(0)], [len(ids)]))
    return model.compute_logits(hidden)


@torch.no_grad()
def test_full_sequence_logits_match_hf(hf_checkpoint):
    folder, hf_model = hf_checkpoint
    ours = load_ours(folder)
    assert ours.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert ours.config.rotary_dim == 4    # partial rotary: 0.25 of head_dim 16
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(2))
    expected = hf_model(ids[None]).logits[0]
    assert (full_forward(ours, ids) - expected).abs().max() < TOL


class PooledSequences:
    """Sequences computed piece by piece through a paged cache and a state pool, as the
    executor does: `step({handle: num_tokens})` runs one ragged pass and returns each
    sequence's logits rows."""

    def __init__(self, model: Qwen3_5ForCausalLM, tokens: dict[int, torch.Tensor]):
        config = model.config
        self.model, self.tokens = model, tokens
        self.cache = PagedKVCache(KVCacheShape(1, config.num_kv_heads, config.head_dim, page_size=8, num_pages=32),
                                  torch.float32, "cpu")
        self.pool = StatePool(state_pool_shape(config, len(tokens)), torch.float32, "cpu")
        self.done = {h: 0 for h in tokens}
        for h in tokens:
            self.pool.allocate(h)

    def step(self, work: dict[int, int]) -> dict[int, torch.Tensor]:
        handles, done = list(work), self.done
        for h in handles:
            self.cache.reserve(h, done[h] + work[h])
        meta = build_metadata(self.cache, handles, [done[h] for h in handles], [work[h] for h in handles], "cpu")
        states = StateBatch(self.pool, [self.pool.rows(h) for h in handles], [work[h] for h in handles])
        ids = torch.cat([self.tokens[h][done[h] : done[h] + work[h]] for h in handles])
        positions = torch.cat([torch.arange(done[h], done[h] + work[h]) for h in handles])
        logits = self.model.compute_logits(self.model(ids, positions, PagedAttention(self.cache, meta), states))
        self.pool.commit(handles)
        rows, out = 0, {}
        for h in handles:
            out[h] = logits[rows : rows + work[h]]
            rows += work[h]
            done[h] += work[h]
        return out


@torch.no_grad()
def test_ragged_batch_of_chunks_and_decodes_matches_full_forward(hf_checkpoint):
    """Sequence a: a prefill chunk, then decode steps next to sequence b's prefill chunks,
    in one batch; states carried through the pool between passes."""
    model = load_ours(hf_checkpoint[0])
    a = torch.randint(0, 512, (76,), generator=torch.Generator().manual_seed(4))
    b = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(5))
    expected_a, expected_b = full_forward(model, a), full_forward(model, b)
    sequences = PooledSequences(model, {0: a, 1: b})
    sequences.step({0: 72})
    got_b = []
    for chunk in (1, 40, 1, 48):                  # b: a one-token chunk, a long one, ...
        out = sequences.step({0: 1, 1: chunk})    # ... each next to a decode step of a
        got_b.append(out[1])
        assert (out[0][-1] - expected_a[sequences.done[0] - 1]).abs().max() < TOL
    assert (torch.cat(got_b) - expected_b).abs().max() < TOL


@pytest.mark.slow
@torch.no_grad()
def test_decode_steps_through_the_fused_kernels_match_full_forward(hf_checkpoint, monkeypatch):
    """The CUDA path's fused kernels, run here in Triton's interpreter (zero-centered
    add+norm, QK-norm + partial rotary, the conv decode step reading a strided packed
    projection, the gated norm, the recurrent kernel over pool rows for the ragged
    prefill and the decode steps): logits equal the unfused full forward's."""
    from omniwalk.kernels import causal_conv, norm_rotary, rms_norm, silu_mul
    from omniwalk.layers import gated_delta_rule
    model = load_ours(hf_checkpoint[0])
    tokens = {0: torch.randint(0, 512, (14,), generator=torch.Generator().manual_seed(6)),
              1: torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(7))}
    expected = {h: full_forward(model, ids) for h, ids in tokens.items()}
    for kernels in (rms_norm, norm_rotary, silu_mul):
        monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    monkeypatch.setattr(causal_conv, "use_triton", lambda x: True)
    monkeypatch.setattr(gated_delta_rule, "use_triton", lambda x: True)
    sequences = PooledSequences(model, tokens)
    sequences.step({0: 10, 1: 6})                 # prefill pieces (the varlen path)
    for _ in range(4):                            # decode steps: all_decode, the fused conv step
        out = sequences.step({0: 1, 1: 1})
        for h in tokens:
            assert (out[h][0] - expected[h][sequences.done[h] - 1]).abs().max() < TOL


@torch.no_grad()
def test_failed_pass_leaves_the_states_untouched(hf_checkpoint):
    model = load_ours(hf_checkpoint[0])
    config = model.config
    pool = StatePool(state_pool_shape(config, 1), torch.float32, "cpu")
    pool.allocate(0)
    committed = pool.rows(0)[0]
    pool.recurrent[:, committed].normal_()
    before = pool.recurrent[:, committed].clone(), pool.conv[:, committed].clone()
    attention = attention_for_tests(1, config.num_kv_heads, config.head_dim, 10)
    handle = model.model.layers[-1].mlp.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.arange(10), torch.arange(10), attention, StateBatch(pool, [pool.rows(0)], [10]))
    finally:
        handle.remove()
    # the pass wrote the other row of the slot; the committed one is as it was
    assert pool.rows(0)[0] == committed
    assert torch.equal(pool.recurrent[:, committed], before[0]) and torch.equal(pool.conv[:, committed], before[1])
    assert pool.recurrent[:, committed ^ 1].any()


# ---------------------------------------------------------------- loading

def test_config_defaults_and_conditional_generation_layout():
    text = {key: value for key, value in TEXT_CONFIG.items() if key != "layer_types"}
    text.update(num_hidden_layers=8, model_type="qwen3_5_text")
    config = qwen3_5.config_from_hf(text)
    assert config.full_attention_layers == (3, 7)            # every 4th, as transformers' default
    assert config.partial_rotary_factor == 0.25 and not config.tie_word_embeddings
    nested = qwen3_5.config_from_hf({"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text})
    assert nested.tie_word_embeddings and nested.linear_attention_layers == (0, 1, 2, 4, 5, 6)
    assert checkpoint_name("model.language_model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert checkpoint_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert checkpoint_name("mtp.fc.weight") is None and checkpoint_name("lm_head.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="multiple"):
        qwen3_5.config_from_hf({**text, "linear_num_value_heads": 3})


@torch.no_grad()
def test_language_model_loads_from_a_conditional_generation_checkpoint(tmp_path, tokenizer):
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=dict(TEXT_CONFIG), vision_config=vision, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    perturb_norms(hf_model)
    hf_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(6))
    expected = hf_model(input_ids=ids[None]).logits[0]
    assert (full_forward(ours, ids) - expected).abs().max() < TOL
    with Engine(EngineArgs(str(tmp_path), device="cpu", dtype="float32")) as engine:
        [result] = engine.generate([ids.tolist()], **greedy(4, ignore_eos=True))
    assert len(result.token_ids) == 4


def test_builtin_tiny_model_is_deterministic():
    config = qwen3_5.tiny_config(512)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    first, second = Qwen3_5ForCausalLM(config), Qwen3_5ForCausalLM(config)
    init_random_weights(first, seed=11)
    torch.manual_seed(123)
    init_random_weights(second, seed=11)
    for (name, p), q in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(p, q), name
    assert not first.model.norm.weight.any()                          # `1 + weight` norms: neutral is 0
    assert torch.equal(first.model.layers[0].linear_attn.norm.weight, torch.ones(16))
    with Engine(EngineArgs("tiny-qwen3_5", enable_prefix_caching=True)) as engine:
        [result] = engine.generate(["Hello"], **greedy(5, ignore_eos=True))
        assert len(result.token_ids) == 5
        assert engine.model.cache.shape.num_layers == 1 and state_pool(engine).shape.num_layers == 3
        assert not engine.model.cache.enable_prefix_caching     # hybrid: kept off whatever was asked


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
def test_greedy_ids_and_logprobs_equal_hf_generate(hf_checkpoint, tokenizer, engine):
    folder, hf_model = hf_checkpoint
    requests = [GenerationRequest(prompt=p, max_tokens=64, sampling=SamplingParams(temperature=0.0, logprobs=1))
                for p in PROMPTS]
    results = engine.generate(requests)
    # chunked prefill: three prompts share a 24-token budget, so chunks of every size
    with Engine(EngineArgs(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=24)) as chunked:
        chunked_results = chunked.generate(requests)
    for prompt, result, chunked_result in zip(PROMPTS, results, chunked_results):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert ids.shape[1] > 80
        out = hf_model.generate(ids, max_new_tokens=64, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        expected = out.sequences[0, ids.shape[1]:].tolist()
        assert result.token_ids == expected and chunked_result.token_ids == expected
        assert len(expected) == 64 and len(set(expected)) > 3   # the check means something
        hf_logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.logits])
        chosen = hf_logprobs[torch.arange(len(expected)), torch.tensor(expected)]
        for got in (result, chunked_result):
            assert torch.allclose(torch.tensor([lp.logprob for lp in got.logprobs]), chosen, atol=TOL)


@pytest.mark.parametrize("n", [1, 2, 3, pytest.param(64, marks=pytest.mark.slow)])
def test_exactly_n_tokens_with_ignore_eos(engine, n):
    before = dict(engine.stats.walk_counts)
    [result] = engine.generate(["Hello there"], **greedy(n, ignore_eos=True))
    assert len(result.token_ids) == n and result.usage.output_tokens == n
    assert result.finish_reason == "length"
    streamed = list(engine.stream("Hello there", **greedy(n, ignore_eos=True)))
    assert [t for c in streamed for t in c.token_ids] == result.token_ids
    decodes = engine.stats.walk_counts.get("decode", 0) - before.get("decode", 0)
    assert engine.stats.walk_counts.get("prefill", 0) - before.get("prefill", 0) == 2
    assert decodes == (0 if n == 1 else 2)   # N = 1 ends at its prefill: no decode walk at all


@pytest.mark.slow
def test_batch_of_16_equals_each_alone(engine):
    rng = random.Random(7)
    requests = []
    for _ in range(16):
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "fox", "cat"]) for _ in range(rng.randint(1, 40)))
        requests.append(GenerationRequest(prompt=words, max_tokens=rng.randint(1, 40), ignore_eos=True,
                                          sampling=SamplingParams(temperature=0.0)))
    together = engine.generate(requests)
    for request, result in zip(requests, together):
        [alone] = engine.generate([request])
        assert alone.token_ids == result.token_ids
        assert len(result.token_ids) == request.max_tokens
    assert state_pool(engine).num_free == state_pool(engine).num_slots


def test_cancel_mid_decode_frees_slots_and_pages(engine):
    allocator, pool = engine.model.cache.allocator, state_pool(engine)
    pages_before, slots_before = allocator.num_free, pool.num_free
    assert slots_before == pool.num_slots
    budget = 400
    streams = [engine.stream(f"cancel me {i}", **greedy(budget, ignore_eos=True)) for i in range(4)]
    iterator = iter(streams[0])
    first = [next(iterator), next(iterator)]       # it is decoding now
    assert allocator.num_free < pages_before and pool.num_free < slots_before
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
    assert allocator.num_free == pages_before and pool.num_free == slots_before
    assert not pool.slots and not engine.model.executors["backbone"].sequences


@pytest.mark.slow
def test_preemption_under_a_tiny_kv_cache_keeps_outputs(engine):
    prompts = [f"request number {i} with some words" for i in range(8)]
    expected = engine.generate(prompts, **greedy(40, ignore_eos=True))
    small = EngineArgs(engine.args.model, device="cpu", dtype="float32", kv_cache_tokens=160, page_size=8,
                       max_num_batched_tokens=32)
    with Engine(small) as tight:
        results = tight.generate(prompts, **greedy(40, ignore_eos=True))
        assert tight.stats.num_preemptions > 0
        assert tight.model.cache.allocator.num_free == tight.model.cache.allocator.num_pages
        assert state_pool(tight).num_free == state_pool(tight).num_slots
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


def test_a_step_that_fails_after_its_forward_is_retried_from_the_committed_states(monkeypatch):
    """The forward wrote every row's next state row, then sampling raised: nothing was
    committed, so the runtime's call-by-call retry reads the same states and the outputs
    equal a run without the failure. Compared by logprobs: the tiny model's greedy ids
    barely depend on its recurrent layers, the logprobs do."""
    from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
    from omniwalk.engine.hybrid_lm_executor import HybridLMExecutor

    batch = [GenerationRequest(prompt=p, max_tokens=12, ignore_eos=True,
                               sampling=SamplingParams(temperature=0.0, logprobs=0))
             for p in ("The quick brown fox", "1 2 3 4", "Once upon a time")]
    args = EngineArgs("tiny-qwen3_5", device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=4)

    def outputs():
        with Engine(args) as engine:
            return [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in engine.generate(batch)]

    expected = outputs()
    calls = {"count": 0}
    original = HybridLMExecutor._sample

    def flaky_sample(self, calls_, logits, **options):
        calls["count"] += 1
        if calls["count"] == 4:       # a decode step of the three requests together
            raise RuntimeError("injected")
        return original(self, calls_, logits, **options)

    monkeypatch.setattr(HybridLMExecutor, "_sample", flaky_sample)
    got = outputs()
    assert calls["count"] > 4 and [ids for ids, _ in got] == [ids for ids, _ in expected]
    # the retried calls run alone, then batched again: other GEMM shapes, float rounding only
    for (_, lps), (_, expected_lps) in zip(got, expected):
        assert torch.allclose(torch.tensor(lps), torch.tensor(expected_lps), atol=1e-5, rtol=0)
