"""Tests for omniwalk.engine.sampler."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omniwalk.engine.sampler import (
    Sampler,
    SamplerOutput,
    filter_top_k_top_p,
    SamplingParams,
    hash_uniform,
    _key_halves,
    row_key,
    row_keys,
)

SAMPLER = Sampler()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams] | SamplingParams,
    seeds: list[int] | None = None,
    sample_indices: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplerOutput:
    b = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * b
    return SAMPLER(
        logits,
        params,
        seeds if seeds is not None else list(range(b)),
        sample_indices if sample_indices is not None else [0] * b,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
    )


def process(logits, params, prompts=None, outputs=None) -> torch.Tensor:
    b = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * b
    return SAMPLER.process_logits(
        logits,
        params,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
    )


def rand_logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_fast_and_slow_path():
    logits = rand_logits(8, 300)
    greedy = SamplingParams(temperature=0.0)
    fast = sample(logits, greedy)
    assert fast.logprobs is None and fast.top_ids is None
    assert torch.equal(fast.token_ids, logits.argmax(-1))
    # logprobs disable the fast path; the choice must not change
    slow = sample(logits, SamplingParams(temperature=0.0, logprobs=2))
    assert torch.equal(slow.token_ids, logits.argmax(-1))
    assert slow.token_ids.dtype == torch.int64


def test_greedy_ties_pick_lowest_index():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0]])
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1)):
        assert sample(logits, p).token_ids.tolist() == [1, 0]


def test_greedy_ignores_sampling_filters_and_seed():
    logits = rand_logits(4, 100, seed=3)
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    a = sample(logits, p, seeds=[1, 2, 3, 4]).token_ids
    b = sample(logits, p, seeds=[9, 8, 7, 6], sample_indices=[5, 5, 5, 5]).token_ids
    assert torch.equal(a, logits.argmax(-1)) and torch.equal(a, b)


def test_bf16_input_and_logits_not_mutated():
    logits = rand_logits(4, 64, seed=5)
    before = logits.clone()
    p = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, top_p=0.9)
    sample(logits, p, prompts=[[1, 2]] * 4, outputs=[[3, 3]] * 4)
    assert torch.equal(logits, before)
    bf = logits.to(torch.bfloat16)
    out = sample(bf, SamplingParams(temperature=0.0, logprobs=1))
    assert torch.equal(out.token_ids, bf.float().argmax(-1))
    assert out.logprobs.dtype == torch.float32
    sampled = sample(bf, SamplingParams(temperature=1.0, seed=1))
    assert sampled.token_ids.shape == (4,)


# ----------------------------------------------------------------------------- penalties


def test_repetition_penalty_changes_argmax_positive_and_negative():
    greedy = lambda **kw: SamplingParams(temperature=0.0, **kw)  # noqa: E731
    pos = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    assert sample(pos, greedy()).token_ids.item() == 0
    # positive logit is divided: 2.0 / 1.2 = 1.67 < 1.9; via the prompt alone
    assert sample(pos, greedy(repetition_penalty=1.2), prompts=[[0]]).token_ids.item() == 1
    # ... and via the output alone
    assert sample(pos, greedy(repetition_penalty=1.2), outputs=[[0]]).token_ids.item() == 1
    # negative logit is multiplied: -1.0 * 1.2 = -1.2 < -1.1
    neg = torch.tensor([[-1.0, -1.1, -5.0]])
    assert sample(neg, greedy(repetition_penalty=1.2), prompts=[[0]]).token_ids.item() == 1
    # penalty < 1 rewards: -1.1 * 0.5 = -0.55 > -1.0
    assert sample(neg, greedy(repetition_penalty=0.5), prompts=[[1]]).token_ids.item() == 1


def test_presence_and_frequency_penalties_change_argmax():
    greedy = lambda **kw: SamplingParams(temperature=0.0, **kw)  # noqa: E731
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits, greedy(presence_penalty=0.5), outputs=[[0]]).token_ids.item() == 1
    # presence/frequency only look at output tokens, not the prompt
    assert sample(logits, greedy(presence_penalty=0.5), prompts=[[0]]).token_ids.item() == 0
    # frequency scales with the count: 2.0 - 0.05 = 1.95 stays, 2.0 - 3 * 0.05 = 1.85 loses
    assert sample(logits, greedy(frequency_penalty=0.05), outputs=[[0]]).token_ids.item() == 0
    assert sample(logits, greedy(frequency_penalty=0.05), outputs=[[0, 0, 0]]).token_ids.item() == 1
    # negative presence penalty promotes a seen token
    assert sample(logits, greedy(presence_penalty=-0.5), outputs=[[2, 1]]).token_ids.item() == 1


def test_presence_frequency_values():
    logits = rand_logits(2, 10, seed=1)
    outputs = [[3, 3, 3, 7], [1]]
    p = SamplingParams(temperature=1.0, presence_penalty=0.25, frequency_penalty=-0.5)
    got = process(logits, p, prompts=[[0, 1, 2], [3]], outputs=outputs)
    expected = logits.clone()
    for r, toks in enumerate(outputs):
        for t in set(toks):
            expected[r, t] -= -0.5 * toks.count(t) + 0.25
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    v = 50
    logits = rand_logits(3, v, seed=11)
    prompts = [[1, 2, 2, 5, 49], [0, 0, 0], [7, 8]]
    outputs = [[5, 6, 60], [10, 11], [8, 7, 7]]  # 60 is outside the vocab: ignored
    ours = process(logits, SamplingParams(temperature=0.0, repetition_penalty=penalty),
                   prompts=prompts, outputs=outputs)
    hf = RepetitionPenaltyLogitsProcessor(penalty=penalty)
    for r in range(3):
        # older transformers versions index out of range on ids >= V, so give it only in-vocab ids
        ids = torch.tensor([[t for t in prompts[r] + outputs[r] if t < v]])
        ref = hf(ids, logits[r : r + 1].clone())
        assert torch.equal(ours[r : r + 1], ref), r


# ----------------------------------------------------------------------------- filters


def _hf_chain(logits, temperature, top_k, top_p, min_p):
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    if top_k > 0:
        x = TopKLogitsWarper(top_k=top_k)(ids, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p=top_p)(ids, x)
    if min_p > 0.0:
        x = MinPLogitsWarper(min_p=min_p)(ids, x)
    return x


FILTER_CASES = [
    (1.0, 10, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (1.0, 0, 0.3, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.0, 0, 1.0, 0.5),
    (0.7, 40, 0.8, 0.0),
    (1.5, 0, 0.95, 0.1),
    (0.5, 25, 0.9, 0.02),
    (2.0, -1, 1.0, 0.0),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTER_CASES)
def test_filters_match_transformers(temperature, top_k, top_p, min_p):
    logits = rand_logits(6, 200, seed=hash((temperature, top_k, top_p, min_p)) % 1000)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ours = process(logits, p)
    ref = _hf_chain(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite])
    if top_k > 0 or top_p < 1.0 or min_p > 0.0:
        assert (~finite).any()  # the case really filters something


def test_filters_in_mixed_batch_match_transformers_per_row():
    logits = rand_logits(len(FILTER_CASES) + 1, 200, seed=99)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in FILTER_CASES]
    params.append(SamplingParams(temperature=0.0, top_k=3))  # greedy row: untouched
    ours = process(logits, params)
    for r, (t, k, p, m) in enumerate(FILTER_CASES):
        ref = _hf_chain(logits[r : r + 1], t, k, p, m)
        assert torch.equal(torch.isfinite(ours[r : r + 1]), torch.isfinite(ref)), r
    assert torch.equal(ours[-1], logits[-1])


def test_top_k_one_equals_greedy():
    logits = rand_logits(64, 500, seed=2)
    out = sample(logits, SamplingParams(temperature=1.3, top_k=1),
                 seeds=list(range(1000, 1064)), sample_indices=list(range(64)))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_filter_ignores_inactive_rows_k_and_clamps_a_k_over_the_vocabulary():
    # a CUDA graph's idle rows hold k = 0 (inactive); a k past the vocabulary keeps everything
    scaled = rand_logits(3, 10, seed=4)
    k = torch.tensor([[0], [3], [50]])
    active = torch.tensor([[False], [True], [True]])
    off = torch.zeros(3, 1, dtype=torch.bool)
    out = filter_top_k_top_p(scaled, k, active, None, off)
    assert torch.equal(out[0], scaled[0]) and torch.equal(out[2], scaled[2])
    assert torch.isfinite(out[1]).sum() == 3 and out[1].argmax() == scaled[1].argmax()


def test_top_p_never_samples_outside_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 3000
    logits = probs.log().expand(n, 4).contiguous()
    out = sample(logits, SamplingParams(top_p=0.7), seeds=list(range(n)))
    counts = torch.bincount(out.token_ids, minlength=4)
    assert counts[2] == 0 and counts[3] == 0
    assert counts[0] > 0 and counts[1] > 0
    # within the nucleus the renormalised split is 0.5 : 0.3
    assert abs(counts[0].item() / n - 0.625) < 0.03


def test_top_k_and_min_p_never_sample_filtered_tokens():
    n = 2000
    logits = rand_logits(1, 100, seed=4, scale=1.0).expand(n, 100).contiguous()
    allowed_k = set(logits[0].topk(5).indices.tolist())
    out = sample(logits, SamplingParams(temperature=2.0, top_k=5), seeds=list(range(n)))
    assert set(out.token_ids.tolist()) <= allowed_k
    assert len(set(out.token_ids.tolist())) == 5
    probs = logits[0].softmax(-1)
    allowed_m = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    out = sample(logits, SamplingParams(min_p=0.5), seeds=list(range(n)))
    assert set(out.token_ids.tolist()) <= allowed_m


# ----------------------------------------------------------------------------- randomness


def _fmix32_ref(h: int) -> int:
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(min_value=-(2**70), max_value=2**70),
    sample_index=st.integers(min_value=0, max_value=2**40),
)
def test_hash_matches_pure_python_reference(seed, sample_index):
    key = row_key(seed, sample_index)
    assert 0 <= key < 2**64
    u = hash_uniform([key], 70000, "cpu")[0]
    for tok in (0, 1, 2, 12345, 65535, 65536, 69999):
        h = _fmix32_ref((_fmix32_ref(tok ^ (key & 0xFFFFFFFF)) + (key >> 32)) & 0xFFFFFFFF)
        assert u[tok].item() == (h + 0.5) / 2**32
    assert (u > 0).all() and (u < 1).all()


@settings(max_examples=30, deadline=None)
@given(seeds=st.lists(st.integers(min_value=-(2**70), max_value=2**70), min_size=1, max_size=20),
       sample_index=st.integers(min_value=0, max_value=2**40))
def test_vectorized_row_keys_equal_row_key(seeds, sample_index):
    """The uint64 numpy keys (sampler rows, SNAC noise) are `row_key`'s, for any seed."""
    indices = [sample_index + i for i in range(len(seeds))]
    expected = [row_key(s, i) for s, i in zip(seeds, indices)]
    assert row_keys(seeds, indices).tolist() == expected
    assert row_keys(seeds, sample_index).tolist() == [row_key(s, sample_index) for s in seeds]
    low, high = _key_halves(row_keys(seeds, indices), "cpu")
    assert (high * 2**32 + low).tolist() == [k - 2**64 if k >= 2**63 else k for k in expected]
    # `high` as aligned as `low` for any batch: Triton would compile a variant for odd ones
    assert (high.data_ptr() - low.data_ptr()) % 16 == 0


def test_uniforms_look_uniform():
    keys = [row_key(s, 0) for s in range(32)]
    u = hash_uniform(keys, 4096, "cpu")
    assert abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    # neighbouring tokens and neighbouring seeds are uncorrelated
    a = u[:, :-1].flatten() - 0.5
    b = u[:, 1:].flatten() - 0.5
    assert abs((a * b).mean().item() / (a * a).mean().item()) < 0.02
    c = (u[:-1] - 0.5).flatten()
    d = (u[1:] - 0.5).flatten()
    assert abs((c * d).mean().item() / (c * c).mean().item()) < 0.02


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(6)
    if kind == 0:
        return SamplingParams(temperature=0.0, logprobs=rng.choice([None, 0, 3]))
    if kind == 1:
        return SamplingParams(temperature=rng.uniform(0.3, 1.5))
    if kind == 2:
        return SamplingParams(temperature=0.8, top_k=rng.randint(1, 60), top_p=rng.uniform(0.5, 1.0))
    if kind == 3:
        return SamplingParams(min_p=rng.uniform(0.0, 0.2), repetition_penalty=1.3, logprobs=5)
    if kind == 4:
        return SamplingParams(temperature=1.2, presence_penalty=0.7, frequency_penalty=0.3, top_p=0.9)
    return SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5)


def _random_batch(rng: random.Random, b: int, v: int, seed: int):
    logits = rand_logits(b, v, seed=seed, scale=rng.choice([1.0, 3.0]))
    params = [_random_params(rng) for _ in range(b)]
    seeds = [rng.randrange(-(2**63), 2**64) for _ in range(b)]
    idx = [rng.randrange(0, 10_000) for _ in range(b)]
    prompts = [[rng.randrange(v) for _ in range(rng.randrange(0, 20))] for _ in range(b)]
    outputs = [[rng.randrange(v) for _ in range(rng.randrange(0, 20))] for _ in range(b)]
    return logits, params, seeds, idx, prompts, outputs


@pytest.mark.parametrize("trial", range(4))
def test_row_result_is_independent_of_batch(trial):
    rng = random.Random(trial)
    b, v = 16, 1000
    logits, params, seeds, idx, prompts, outputs = _random_batch(rng, b, v, seed=trial)
    batch = SAMPLER(logits, params, seeds, idx, prompts, outputs)
    for r in range(b):
        alone = SAMPLER(logits[r : r + 1].clone(), [params[r]], [seeds[r]], [idx[r]],
                        [prompts[r]], [outputs[r]])
        assert batch.token_ids[r].item() == alone.token_ids[0].item(), r
        if alone.logprobs is not None:
            assert batch.logprobs[r].item() == alone.logprobs[0].item()
        if alone.top_ids is not None:
            k = alone.top_ids.shape[1]
            assert torch.equal(batch.top_ids[r, :k], alone.top_ids[0])
    # a different order of the same rows gives each row the same token
    perm = list(range(b))
    rng.shuffle(perm)
    shuffled = SAMPLER(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm],
                       [idx[i] for i in perm], [prompts[i] for i in perm], [outputs[i] for i in perm])
    assert torch.equal(shuffled.token_ids, batch.token_ids[perm])


def test_same_seed_same_token_different_seeds_different_tokens():
    v, n = 1000, 300
    logits = torch.zeros(n, v)  # uniform over 1000 tokens
    p = SamplingParams()
    by_seed = sample(logits, p, seeds=list(range(n))).token_ids
    again = sample(logits, p, seeds=list(range(n))).token_ids
    assert torch.equal(by_seed, again)
    # expected number of distinct tokens among 300 uniform draws over 1000 is about 259
    assert len(set(by_seed.tolist())) > 200
    by_index = sample(logits, p, seeds=[42] * n, sample_indices=list(range(n))).token_ids
    assert len(set(by_index.tolist())) > 200
    # the seed (not the row position) decides
    flipped = sample(logits, p, seeds=list(range(n))[::-1]).token_ids
    assert torch.equal(flipped, by_seed.flip(0))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    target = torch.softmax(probs.log() / temperature, dim=-1)
    p = SamplingParams(temperature=temperature)
    over_seeds = sample(logits, p, seeds=list(range(n))).token_ids
    freq = torch.bincount(over_seeds, minlength=4).float() / n
    assert (freq - target).abs().max() < 0.03, freq
    over_steps = sample(logits, p, seeds=[7] * n, sample_indices=list(range(n))).token_ids
    freq = torch.bincount(over_steps, minlength=4).float() / n
    assert (freq - target).abs().max() < 0.03, freq


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_and_top_k_is_max_requested():
    logits = rand_logits(5, 100, seed=8)
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, top_p=0.5, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0, logprobs=5),
        SamplingParams(logprobs=None),
        SamplingParams(temperature=1.5, top_k=4, logprobs=0),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=1),
    ]
    outputs = [[int(t)] * 5 for t in logits.argmax(-1)]  # every row repeats its raw argmax
    out = sample(logits, params, outputs=outputs, seeds=[3, 1, 4, 1, 5])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.shape == (5,) and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (5, 5) and out.top_ids.dtype == torch.int64
    assert out.top_logprobs.shape == (5, 5) and out.top_logprobs.dtype == torch.float32
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_ids))
    torch.testing.assert_close(out.top_logprobs, raw.topk(5, dim=-1).values)
    # the penalties moved the greedy rows away from the raw argmax
    assert out.token_ids[1] != logits[1].argmax() and out.token_ids[4] != logits[4].argmax()


def test_logprobs_absent_or_zero():
    logits = rand_logits(3, 20, seed=9)
    none = sample(logits, SamplingParams(temperature=0.8))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None
    zero = sample(logits, [SamplingParams(logprobs=0), SamplingParams(), SamplingParams()])
    assert zero.logprobs is not None and zero.logprobs.shape == (3,)
    assert zero.top_ids is None and zero.top_logprobs is None


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges():
    SamplingParams(temperature=0.0, top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, logprobs=20, seed=-5)
    SamplingParams(top_k=0, min_p=0.0, logprobs=0)
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_sampler_rejects_mismatched_inputs():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="params"):
        SAMPLER(logits, [SamplingParams()], [0, 1], [0, 0], [[], []], [[], []])
    with pytest.raises(ValueError, match="seeds"):
        SAMPLER(logits, [SamplingParams()] * 2, [0], [0, 0], [[], []], [[], []])


# ----------------------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_agree():
    rng = random.Random(123)
    for trial in range(4):
        logits, params, seeds, idx, prompts, outputs = _random_batch(rng, 64, 32000, seed=trial)
        cpu = SAMPLER(logits, params, seeds, idx, prompts, outputs)
        gpu = SAMPLER(logits.cuda(), params, seeds, idx, prompts, outputs)
        assert torch.equal(cpu.token_ids, gpu.token_ids.cpu()), trial
        if cpu.logprobs is not None:
            torch.testing.assert_close(cpu.logprobs, gpu.logprobs.cpu())
    keys = [row_key(s, i) for s in range(8) for i in range(4)]
    assert torch.equal(hash_uniform(keys, 50000, "cpu"), hash_uniform(keys, 50000, "cuda").cpu())


def test_numpy_histories_give_the_same_samples_as_lists():
    import numpy as np

    torch.manual_seed(5)
    logits = torch.randn(4, 64)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.4, seed=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, repetition_penalty=0.8, frequency_penalty=-0.3, seed=3)]
    prompts = [[1, 2, 3], [5, 5, 6], [], [63, 0]]
    outputs = [[4, 4], [6, 7, 7, 7], [9], []]
    sampler = Sampler()
    as_lists = sampler(logits, params, [0, 1, 2, 3], [2, 4, 1, 0], prompts, outputs)
    as_arrays = sampler(logits, params, [0, 1, 2, 3], [2, 4, 1, 0],
                        [np.array(p, dtype=np.int64) for p in prompts], [np.array(o, dtype=np.int64) for o in outputs])
    assert torch.equal(as_lists.token_ids, as_arrays.token_ids)
    processed = sampler.process_logits(logits, params, prompts, outputs)
    assert torch.equal(processed, sampler.process_logits(
        logits, params, [np.array(p, dtype=np.int64) for p in prompts], [np.array(o, dtype=np.int64) for o in outputs]))


def _dense_race(scaled, seeds, sample_indices):
    from omniwalk.engine.sampler import hash_uniform, row_key

    keys = [row_key(s, i) for s, i in zip(seeds, sample_indices)]
    u = hash_uniform(keys, scaled.shape[1], scaled.device)
    return (scaled.to(torch.float64) - torch.log(-torch.log(u))).argmax(dim=-1)


@pytest.mark.parametrize("keep", [1, 3, 40, 200])
def test_race_over_candidates_only_picks_what_the_dense_race_picks(keep):
    torch.manual_seed(keep)
    rows, vocab = 12, 1000
    scaled = torch.randn(rows, vocab) * 3
    # keep a few entries per row (as top-p / a logits mask would), at random positions
    order = torch.rand(rows, vocab).argsort(dim=-1)
    mask = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(1, order[:, :keep], True)
    scaled = scaled.masked_fill(~mask, float("-inf"))
    scaled[3] = float("-inf")                       # a row with nothing left: both give 0
    scaled[5, :] = float("-inf")
    scaled[5, 7] = scaled[5, 9] = 1.0               # two equal finite logits
    seeds, indices = list(range(100, 100 + rows)), list(range(rows))
    assert int(torch.isfinite(scaled).sum()) * 4 <= rows * vocab     # the sparse path runs
    assert torch.equal(Sampler._race(scaled, seeds, indices), _dense_race(scaled, seeds, indices))


@pytest.mark.parametrize("kernel", [False, True])
def test_sampling_over_candidate_ids_picks_the_full_vocabulary_sample(monkeypatch, kernel):
    """A row restricted to some ids (the rest -inf) samples the same id whether the sampler
    sees the whole vocabulary or only those ids' columns (`candidate_ids`): penalties count
    ids, the race hashes ids; greedy, filters and penalties mixed in one batch."""
    gen = torch.Generator().manual_seed(21)
    vocab, rows, width = 3000, 6, 300
    logits = torch.randn(rows, vocab, generator=gen) * 3
    starts = [0, 500, 1000, 1500, 2000, 2500]
    candidates = torch.stack([torch.cat([torch.tensor([7]), torch.arange(s + 10, s + 10 + width - 1)])
                              for s in starts])                       # an EOS-like id first, then a range
    allowed = torch.ones(rows, width, dtype=torch.bool)
    allowed[::2, 0] = False                                           # some rows may not stop
    full = torch.full_like(logits, float("-inf"))
    full.scatter_(1, candidates, logits.gather(1, candidates).masked_fill(~allowed, float("-inf")))
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1),
              SamplingParams(temperature=1.1, top_k=20, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0.6, min_p=0.1),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0)]
    history = [list(candidates[r, 1:40:3].tolist()) + [7, 2999] for r in range(rows)]
    if kernel:
        pytest.importorskip("triton")
        from omniwalk.engine import sampler as sampler_module
        monkeypatch.setattr(sampler_module, "use_triton", lambda x: True)
    for trial in range(5):
        seeds, indices = [trial * 10 + r for r in range(rows)], [trial] * rows
        expected = Sampler()(full.clone(), params, seeds, indices, [[5, 8]] * rows, history).token_ids
        compact = full.gather(1, candidates)
        got = Sampler()(compact, params, seeds, indices, [[5, 8]] * rows, history,
                        candidate_ids=candidates, vocab_size=vocab).token_ids
        assert got.tolist() == expected.tolist()
