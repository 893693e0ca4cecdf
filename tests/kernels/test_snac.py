"""SNAC's kernels (Snake, depthwise conv with and without a Snake after it, 1x1 conv with the
residual add or the noise or neither) against their torch references, in Triton's
interpreter on CPU. Inside the whole decoder: tests/models/test_orpheus.py."""

import pytest
import torch

pytest.importorskip("triton")

from omniwalk.kernels import snac  # noqa: E402


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setattr(snac, "use_triton", lambda x: True)


def test_snake():
    x, alpha = torch.randn(2, 5, 37) * 3, torch.rand(1, 5, 1) + 0.5
    torch.testing.assert_close(snac.snake(x, alpha), snac.snake_reference(x, alpha), atol=1e-5, rtol=1e-5)


def test_snake_beta_on_cropped_rows():
    padded = torch.randn(2, 5, 45) * 3
    x = padded[..., :37]   # a causal conv's output, cropped: rows 45 apart
    alpha, beta = torch.rand(1, 5, 1) + 0.5, torch.rand(1, 5, 1) + 0.1
    out = snac.snake(x, alpha, beta)
    assert out.is_contiguous()
    torch.testing.assert_close(out, snac.snake_beta_reference(x, alpha, beta), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dilation", [1, 3, 9])   # windows reaching past both ends of a short input
def test_depthwise_conv_alone_and_with_the_next_snake(dilation):
    x, alpha = torch.randn(2, 5, 37) * 3, torch.rand(1, 5, 1) + 0.5
    weight, bias = torch.randn(5, 1, 7) * 0.3, torch.randn(5)
    expected = snac.depthwise_conv1d_reference(x, weight, bias, dilation, 3 * dilation)
    torch.testing.assert_close(snac.depthwise_conv1d(x, weight, bias, dilation, 3 * dilation), expected,
                               atol=1e-5, rtol=1e-5)
    fused = snac.depthwise_conv1d(x, weight, bias, dilation, 3 * dilation, snake_alpha=alpha)
    torch.testing.assert_close(fused, snac.snake_reference(expected, alpha), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(snac.depthwise_conv1d_reference(x, weight, bias, dilation, 3 * dilation, alpha),
                               snac.snake_reference(expected, alpha))


# 1x1 conv: channel counts and lengths off the kernel's blocks, with and without bias / noise
@pytest.mark.parametrize("channels_in,channels_out,length", [(5, 7, 37), (48, 70, 300)])
def test_pointwise_conv(channels_in, channels_out, length):
    y, residual = torch.randn(2, channels_in, length), torch.randn(2, channels_out, length)
    weight, bias, noise = torch.randn(channels_out, channels_in, 1), torch.randn(channels_out), torch.randn(2, 1, length)
    for b, scale in ((bias, None), (None, noise), (bias, noise)):
        torch.testing.assert_close(snac.pointwise_conv(y, weight, b, residual, scale),
                                   snac.pointwise_conv_reference(y, weight, b, residual, scale),
                                   atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(snac.pointwise_conv(y, weight, None, None),
                               torch.nn.functional.conv1d(y, weight), atol=1e-4, rtol=1e-5)
