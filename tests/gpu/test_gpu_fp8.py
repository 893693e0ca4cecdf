"""FP8 linear layers on the GPU (`-m gpu`): the Triton quantization and `_scaled_mm` against
the CPU path's math, and the decode graphs against eager steps with an FP8 backbone."""

import pytest
import torch

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.kernels.fp8 import quantize_rows, quantize_rows_reference
from omniwalk.kernels.rms_norm import add_rms_norm, rms_norm
from omniwalk.kernels.silu_mul import silu_and_mul
from omniwalk.layers import fp8_linear
from omniwalk.layers.fp8_linear import Fp8Linear, fp8_supported

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")),
                                 reason="needs a GPU with FP8 tensor cores")]


@pytest.mark.parametrize("width", [96, 3072, 5120, 8192])
def test_quantization_kernel_is_the_reference_bit_for_bit(width):
    gen = torch.Generator("cuda").manual_seed(width)
    x = (torch.randn(37, width, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    x[3] = 0
    got, got_scale = quantize_rows(x)
    expected, expected_scale = quantize_rows_reference(x)
    assert torch.equal(got_scale, expected_scale)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def _assert_rows_equal(fused, x):
    expected, expected_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    assert torch.equal(fused.scale, expected_scale)
    assert torch.equal(fused.values.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("width", [96, 3072])
def test_norms_quantizing_their_output_write_the_quantized_norm_bit_for_bit(width, zero_centered):
    gen = torch.Generator("cuda").manual_seed(width)
    x, residual = (torch.randn(2, 37, width, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(width, generator=gen, device="cuda").to(torch.bfloat16)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6, zero_centered)
    fused, fused_summed = add_rms_norm(x, residual, weight, 1e-6, zero_centered, quantize=True)
    assert torch.equal(fused_summed, summed) and fused.dtype == torch.bfloat16
    _assert_rows_equal(fused, normed)
    _assert_rows_equal(rms_norm(x, weight, 1e-6, zero_centered, quantize=True),
                       rms_norm(x, weight, 1e-6, zero_centered))


@pytest.mark.parametrize("width", [96, 8192])
def test_silu_mul_quantizing_its_output_writes_the_quantized_product_bit_for_bit(width):
    gen = torch.Generator("cuda").manual_seed(width)
    gate_up = (torch.randn(37, 2 * width, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    gate, up = gate_up.split(width, dim=-1)   # strided halves of one projection, as in the MLP
    _assert_rows_equal(silu_and_mul(gate, up, quantize=True), silu_and_mul(gate, up))


def test_fused_input_quantization_samples_the_ids_of_the_unfused_engine(monkeypatch):
    prompts = ["The quick brown fox", "Once upon a time", "1 2 3 4"]
    requests = [GenerationRequest(prompt=p, max_tokens=12, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    ids = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(fp8_linear, "fuse_input_quantization", lambda model: 0)
        args = EngineArgs("tiny-llama", device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_tokens=8192,
                          max_num_seqs=8)
        with Engine(args) as engine:
            assert engine.model.lm.model.layers[0].input_layernorm.quantize_output == fused
            ids[fused] = [r.token_ids for r in engine.generate(requests)]
    assert ids[True] == ids[False]


def test_scaled_mm_is_the_product_of_the_dequantized_operands():
    torch.manual_seed(0)
    linear = torch.nn.Linear(3072, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear(linear)
    assert layer.use_scaled_mm
    x = torch.randn(200, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x).float()
        xq, xs = quantize_rows_reference(x)
        manual = (xq.float() @ layer.weight.float().t()) * xs * layer.weight_scale
        plain = linear(x).float()
    torch.testing.assert_close(got, manual, rtol=1.6e-2, atol=3e-2)   # two bf16 units of the output
    assert (got - plain).norm() / plain.norm() < 0.05


def test_decode_graphs_with_an_fp8_backbone_match_eager_steps():
    prompts = ["The quick brown fox", "Once upon a time", "1 2 3 4"]
    requests = [GenerationRequest(prompt=p, max_tokens=12, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    ids = {}
    for eager in (False, True):
        args = EngineArgs("tiny-llama", device="cuda", dtype="bfloat16", quantization="fp8", enforce_eager=eager,
                          kv_cache_tokens=8192, max_num_seqs=8)
        with Engine(args) as engine:
            assert isinstance(engine.model.lm.model.layers[0].mlp.down_proj, Fp8Linear)
            ids[eager] = [r.token_ids for r in engine.generate(requests)]
    assert ids[False] == ids[True]
    assert all(len(x) == 12 for x in ids[True])
