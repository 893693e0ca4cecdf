"""The GEMV kernel of decode-step projections against F.linear (Triton's interpreter on CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.kernels.gemv import gemv  # noqa: E402


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k, bias", [(40, 72, False), (17, 600, True)])
def test_gemv_matches_linear(rows, n, k, bias):
    # N and K not multiples of the tiles, several K tiles, 3 rows padded to 4
    gen = torch.Generator().manual_seed(rows * n)
    x, weight = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    torch.testing.assert_close(gemv(x, weight, b, tiles=(8, 64, 4, 3)), torch.nn.functional.linear(x, weight, b),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_with_preloaded_weights_matches_linear(rows):
    # the one-block layout PDL launches take: all of K read at once, before the wait
    gen = torch.Generator().manual_seed(rows)
    x, weight, b = torch.randn(rows, 600, generator=gen), torch.randn(17, 600, generator=gen), torch.randn(17, generator=gen)
    torch.testing.assert_close(gemv(x, weight, b, tiles=(4, 64, 4, 3), preload=True),
                               torch.nn.functional.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_more_rows_fall_back_to_linear():
    x, weight = torch.randn(9, 16), torch.randn(8, 16)
    torch.testing.assert_close(gemv(x, weight), x @ weight.T)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemv_matches_linear_on_cuda_bf16(rows):
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(gemv(x, weight).float(), (x.float() @ weight.float().T), atol=2e-2, rtol=2e-2)


def test_only_graph_launches_take_pdl():
    from omniwalk.kernels.triton_support import graph_launches, pdl_launch

    x = torch.zeros(2)
    assert pdl_launch(x) == {"PDL": False}
    with graph_launches():   # a CPU tensor never takes it, graph or not
        assert pdl_launch(x) == {"PDL": False}


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_equals_eager():
    # norm -> gemv -> norm -> gemv, captured with PDL (Hopper), replayed on new inputs: the
    # kernels' waits keep the chain's order, so the graph matches the same ops run eagerly
    from omniwalk.engine.cuda_graphs import capture_per_bucket
    from omniwalk.kernels.rms_norm import add_rms_norm
    from omniwalk.kernels.triton_support import graph_launches, pdl_launch

    torch.manual_seed(0)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    w1, w2 = (torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16) * 0.02 for n in (5120, 2048))
    norm = torch.ones(2048, device="cuda", dtype=torch.bfloat16)

    def forward(_):
        hidden, res = add_rms_norm(x, residual, norm, 1e-6)
        hidden = gemv(hidden, w1)[:, :2048].contiguous()
        hidden, res = add_rms_norm(hidden, res, norm, 1e-6)
        return gemv(hidden, w2) + res

    with graph_launches():
        assert pdl_launch(x)["PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    graph, out = capture_per_bucket(x.device, [1], forward)[1]
    for seed in range(3):
        torch.manual_seed(seed + 1)
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(x))
        graph.replay()
        # a race would read stale rows: far off; the graph's one-row GEMV sums K in one block
        # (its weights preloaded), eagerly in two, so the last bf16 bit may differ
        torch.testing.assert_close(out, forward(1), atol=2e-2, rtol=2e-2)
