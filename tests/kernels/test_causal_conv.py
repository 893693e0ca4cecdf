"""The causal conv's decode kernel over state-pool rows against the torch reference (Triton's
interpreter on CPU), and the ragged torch version against the conv per sequence."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.engine.ragged import RaggedLengths  # noqa: E402
from omniwalk.kernels import causal_conv  # noqa: E402
from omniwalk.kernels.state_rows import StateRows  # noqa: E402


def assert_close(got, expected):
    # fp32: reduction order only. bf16: a few units in the last place, because Triton's CPU
    # interpreter truncates when casting to bf16 where the GPU rounds to nearest.
    tolerance = dict(atol=1e-5, rtol=1e-5) if expected.dtype == torch.float32 else dict(atol=7e-2, rtol=3e-2)
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("taps", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_decode_step(monkeypatch, taps, dtype):
    """The decode kernel reads each row's state from one pool row and writes the new state
    to another, leaving every other row as it was."""
    monkeypatch.setattr(causal_conv, "use_triton", lambda x: True)
    torch.manual_seed(4)
    x = torch.randn(3, 70, dtype=dtype)[:, 10:50]   # a strided view, as from a packed projection
    weight = torch.randn(40, taps, dtype=dtype)
    pool = torch.randn(7, 40, taps - 1, dtype=dtype)
    read, write = torch.tensor([5, 0, 2]), torch.tensor([4, 1, 3])
    expected_out, expected_state = causal_conv.causal_conv1d(x[:, None], weight, pool[read])
    for parts in (None, (12, 12, 16)):   # one output, or q | k | v
        rows = StateRows(pool.clone(), read, write)
        outputs = causal_conv.causal_conv1d_decode(x, weight, rows, parts=parts)
        assert len(outputs) == (1 if parts is None else 3) and all(p.is_contiguous() for p in outputs)
        assert_close(torch.cat(outputs, dim=-1), expected_out[:, 0])
        assert torch.equal(rows.pool[write], expected_state)
        others = [r for r in range(7) if r not in write.tolist()]
        assert torch.equal(rows.pool[others], pool[others])


@pytest.mark.parametrize("taps", [2, 4])
def test_ragged_causal_conv1d_equals_the_conv_per_sequence(taps):
    """Decode rows, pieces shorter than the carried state and longer ones, in one batch."""
    torch.manual_seed(5)
    lengths = [1, 2, 7, 1, 3]
    x = torch.randn(sum(lengths), 24)
    weight = torch.randn(24, taps)
    state = torch.randn(len(lengths), 24, taps - 1)
    ragged = RaggedLengths(lengths, "cpu", conv_kernel=taps)
    out, new_state = causal_conv.ragged_causal_conv1d(x, weight, state, *ragged.conv_indices)
    start = 0
    for i, length in enumerate(lengths):
        expected_out, expected_state = causal_conv.causal_conv1d(x[None, start : start + length], weight, state[i, None])
        assert_close(out[start : start + length], expected_out[0])
        assert torch.equal(new_state[i], expected_state[0])
        start += length
