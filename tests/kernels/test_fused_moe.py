"""The MoE experts' Triton grouped GEMMs and grouped_mm path against the torch reference
(Triton's interpreter on CPU), and the alignment of pairs into per-expert blocks.

The kernel runs here in fp32 and fp16: Triton's interpreter (3.9) multiplies bf16 operands of
`tl.dot` as their raw uint16 bits. fp16 takes the same path as bf16 (the roundings to the
activation dtype); bf16 itself is checked on the GPU (tests/layers/test_moe.py, `-m gpu`)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.kernels import fused_moe  # noqa: E402
from omniwalk.kernels.fused_moe import MoeTiles  # noqa: E402

MASKED = MoeTiles(64, True, up=(32, 128, 4, 4), down=(64, 128, 4, 4))
ALIGNED_16 = MoeTiles(16, False, up=(16, 16, 4, 3), down=(16, 16, 4, 3))   # several N and K tiles
ALIGNED_32 = MoeTiles(32, False, up=(64, 128, 4, 3), down=(64, 128, 4, 3))
GEMV = MoeTiles(1, False, up=(16, 16, 4, 3), down=(16, 16, 4, 3), gemv=True)   # several N and K tiles


def make_experts(num_experts, hidden, intermediate, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, intermediate, generator=gen) * 0.2
    return gate_up.to(dtype), down.to(dtype)


def route(num_tokens, num_experts, top_k, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(dtype)
    return fused_moe.select_experts(logits, top_k, norm_topk_prob=True)


def assert_close(got, expected):
    # fp16: the same roundings; the k rows summed in fp32 where the reference adds in fp16
    tolerance = dict(atol=1e-5, rtol=1e-5) if expected.dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, expected, **tolerance)


def test_alignment_of_the_docstring_example():
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]])
    sorted_pairs, block_experts = fused_moe.align_pairs_to_blocks(topk_ids, num_experts=4, block_m=4)
    s = 10   # the sentinel: T * k
    assert sorted_pairs[:16].tolist() == [1, 4, 9, s, 0, 2, 5, 7, 8, s, s, s, 3, 6, s, s]
    assert torch.all(sorted_pairs[16:] == s)
    assert block_experts[:4].tolist() == [0, 2, 2, 3]
    # blocks for any routing: (10 pairs + 4 experts' padding of at most 3 rows each) // 4
    assert block_experts.shape == (5,) and sorted_pairs.shape == (20,)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [(1, 8, 2, 16), (37, 8, 3, 16), (200, 16, 4, 8)])
def test_alignment_puts_every_pair_once_in_a_block_of_its_expert(num_tokens, num_experts, top_k, block_m):
    _, topk_ids = route(num_tokens, num_experts, top_k, torch.float32, seed=num_tokens)
    sorted_pairs, block_experts = fused_moe.align_pairs_to_blocks(topk_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    real = sorted_pairs[sorted_pairs < num_pairs].long()
    assert sorted(real.tolist()) == list(range(num_pairs))
    blocks = sorted_pairs.view(-1, block_m)
    for block, expert in zip(blocks, block_experts.tolist()):
        pairs = block[block < num_pairs].long()
        assert torch.all(topk_ids.reshape(-1)[pairs] == expert)
        assert pairs.tolist() == sorted(pairs.tolist())   # token order within an expert


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [(1, 8, 2, 16), (37, 8, 3, 16), (200, 16, 4, 8),
                                                                    (32, 128, 8, 16)])
def test_the_alignment_kernel_matches_the_torch_alignment(num_tokens, num_experts, top_k, block_m):
    # the same blocks and the same set of pairs in each (the order within an expert may differ)
    _, topk_ids = route(num_tokens, num_experts, top_k, torch.float32, seed=num_tokens)
    expected_pairs, expected_experts = fused_moe.align_pairs_to_blocks(topk_ids, num_experts, block_m)
    num_blocks = expected_experts.shape[0]
    pairs, experts = fused_moe.align_pairs_to_blocks_triton(topk_ids, num_experts, block_m, num_blocks)
    assert pairs.shape == expected_pairs.shape and experts.shape == expected_experts.shape
    used = (expected_pairs.view(num_blocks, block_m) < num_tokens * top_k).any(dim=1)
    assert torch.equal(experts[used], expected_experts[used])
    as_sets = lambda blocks: [sorted(b.tolist()) for b in blocks.view(num_blocks, block_m)]
    assert as_sets(pairs) == as_sets(expected_pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, tiles", [(1, None), (3, MASKED), (40, None), (13, ALIGNED_16), (29, ALIGNED_32), (2, GEMV), (5, GEMV)])
def test_fused_moe_matches_the_reference(num_tokens, tiles, dtype):
    # hidden and intermediate not multiples of the tiles: the N and K masks matter
    num_experts, hidden, intermediate, top_k = 8, 40, 24, 2
    gate_up, down = make_experts(num_experts, hidden, intermediate, dtype)
    weights, ids = route(num_tokens, num_experts, top_k, dtype)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = fused_moe.moe_experts_reference(x, weights, ids, gate_up, down)
    got = fused_moe.fused_moe(x, weights, ids, gate_up, down, tiles)
    assert got.shape == expected.shape and got.dtype == dtype
    assert_close(got, expected)


def test_the_default_tiles_mask_decode_and_align_prefill():
    assert fused_moe.moe_tiles(8, 128).gemv and fused_moe.moe_tiles(16, 128).gemv   # one or two tokens
    assert fused_moe.moe_tiles(24, 128).masked and fused_moe.moe_tiles(24, 128).block_m == 32
    assert fused_moe.moe_tiles(64, 128).masked and fused_moe.moe_tiles(64, 128).block_m == 64
    block_ms = [fused_moe.moe_tiles(tokens * 8, 128).block_m for tokens in (32, 256, 1024, 4096)]
    assert not any(fused_moe.moe_tiles(tokens * 8, 128).masked for tokens in (32, 256, 1024, 4096))
    assert block_ms == sorted(block_ms) and block_ms[0] == 16 and block_ms[-1] == 128


def test_masked_tiles_refuse_more_pairs_than_rows():
    gate_up, down = make_experts(4, 32, 16, torch.float32)
    weights, ids = route(40, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="masked"):
        fused_moe.fused_moe(torch.randn(40, 32), weights, ids, gate_up, down, MASKED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 17, 64])
def test_grouped_mm_matches_the_reference(num_tokens, dtype):
    num_experts, hidden, intermediate, top_k = 8, 32, 16, 3
    gate_up, down = make_experts(num_experts, hidden, intermediate, dtype)
    weights, ids = route(num_tokens, num_experts, top_k, dtype, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    expected = fused_moe.moe_experts_reference(x, weights, ids, gate_up, down)
    got = fused_moe.moe_experts_grouped_mm(x, weights, ids, gate_up, down)
    # bf16: the same roundings, but the k rows summed in fp32 where the reference adds in bf16
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)


def test_routing_renormalizes_only_when_asked():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = fused_moe.select_experts(logits, 2, norm_topk_prob=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, probs[:, [3, 2]])
    weights, _ = fused_moe.select_experts(logits.bfloat16(), 2, norm_topk_prob=True)
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights.float(), (probs[:, [3, 2]] / probs[:, [3, 2]].sum()), atol=4e-3, rtol=0)


def test_an_unknown_backend_is_refused():
    gate_up, down = make_experts(4, 32, 16, torch.float32)
    weights, ids = route(2, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="unknown MoE backend"):
        fused_moe.moe_experts(torch.randn(2, 32), weights, ids, gate_up, down, "cutlass")


@pytest.mark.parametrize("num_tokens,num_experts,top_k,normalize", [(1, 128, 8, True), (7, 128, 8, True),
                                                                      (5, 60, 4, False), (9, 8, 2, True)])
def test_routing_kernel_matches_the_reference(num_tokens, num_experts, top_k, normalize):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = fused_moe.routing(logits, top_k, normalize)
    expected_weights, expected_ids = fused_moe.select_experts_reference(logits, top_k, normalize)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


def test_sum_pairs_sums_over_k_in_fp32():
    by_pair = torch.randn(3, 8, 70, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    got = fused_moe.sum_pairs(by_pair)
    assert torch.equal(got, by_pair.float().sum(dim=1).to(torch.float16))
