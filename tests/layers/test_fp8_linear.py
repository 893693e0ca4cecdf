"""FP8 linear layers (`--quantization fp8`): the quantization, the layer, the swap, the loaders.

The CPU path multiplies the same quantized values in fp32; tests/gpu checks `_scaled_mm`
and the Triton kernel against it (Triton's CPU interpreter does not convert to fp8 as the
GPU does, so the kernel is only compiled in CI: tests/kernels/compile_for_hopper.py)."""

import pytest
import torch
from torch import nn

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Rows, quantize_rows, quantize_rows_reference
from omniwalk.layers import fp8_linear
from omniwalk.layers.fp8_linear import Fp8Linear, fuse_input_quantization, quantize_linear_layers
from omniwalk.loading import load_model


def test_rows_quantize_to_their_largest_magnitude_and_round_within_e4m3_precision():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=gen) * torch.tensor([1e-3, 1, 10, 300, 1, 1])[:, None]
    x[5] = 0.0
    quantized, scale = quantize_rows(x)
    assert quantized.dtype == FP8_DTYPE and scale.shape == (6, 1)
    assert torch.equal(scale[:5, 0], x[:5].abs().amax(-1) * (1.0 / FP8_MAX))
    values = quantized.float()
    assert torch.equal(values[:5].abs().amax(-1), torch.full((5,), FP8_MAX))   # the largest maps to 448 exactly
    assert torch.all(values[5] == 0) and torch.isfinite(scale).all()            # a zero row: zeros, no NaN
    # e4m3 keeps 3 mantissa bits: each normal value rounds within 1/16 relative
    restored, exact = values * scale, x
    normal = values.abs() >= 2.0 ** -6
    assert torch.all((restored - exact).abs()[normal] <= exact.abs()[normal] / 16)


def test_fp8_linear_matches_the_linear_within_quantization_error():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True)
    layer = Fp8Linear(linear)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (1, 64)
    x = torch.randn(3, 5, 128)
    with torch.no_grad():
        expected, got = linear(x), layer(x)
    assert got.shape == (3, 5, 64)
    assert (got - expected).norm() / expected.norm() < 0.05
    # exactly the product of the dequantized operands
    xq, xs = quantize_rows_reference(x.reshape(-1, 128))
    wq, ws = quantize_rows_reference(linear.weight)
    manual = (xq.float() * xs) @ (wq.float() * ws).t() + linear.bias
    assert torch.allclose(got.reshape(-1, 64), manual, rtol=1e-5, atol=1e-5)


def test_swap_takes_the_decoder_projections_and_nothing_else():
    loaded = load_model(EngineArgs("tiny-llama"))
    lm = loaded.served.lm
    before = lm.lm_head.weight.clone()
    swapped = quantize_linear_layers(lm)
    layers = lm.model.layers
    assert swapped == 4 * len(layers)
    for layer in layers:
        assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.self_attn.o_proj, Fp8Linear)
        assert isinstance(layer.mlp.gate_up_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    # the head stays as it was (a ParallelLMHead: an nn.Linear on one device)
    assert not isinstance(lm.lm_head, Fp8Linear) and torch.equal(lm.lm_head.weight, before)


@pytest.mark.parametrize("model", [pytest.param("tiny-llama", marks=pytest.mark.slow), "tiny-qwen3"])
def test_an_fp8_engine_generates_close_to_the_unquantized_one(model):
    prompt = GenerationRequest(prompt="The quick brown fox", max_tokens=6,
                               sampling=SamplingParams(temperature=0.0, logprobs=0))
    outputs = {}
    for quantization in (None, "fp8"):
        with Engine(EngineArgs(model, quantization=quantization)) as engine:
            if quantization:
                assert isinstance(engine.model.lm.model.layers[0].mlp.down_proj, Fp8Linear)
            outputs[quantization] = engine.generate([prompt])[0]
    plain, fp8 = outputs[None], outputs["fp8"]
    assert len(fp8.token_ids) == 6 and fp8.finish_reason == "length"
    # the first token: the same greedy choice, its log-probability within 0.1 nats
    assert fp8.token_ids[0] == plain.token_ids[0]
    assert abs(plain.logprobs[0].logprob - fp8.logprobs[0].logprob) < 0.1


def test_a_projection_takes_rows_its_producer_quantized():
    torch.manual_seed(0)
    layer = Fp8Linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(5, 64).to(torch.bfloat16)
    rows = Fp8Rows.of(x)
    assert rows.shape == (5, 64) and rows.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(layer(rows), layer(x))


def test_norms_and_silu_mul_quantize_for_their_fp8_projection_with_the_same_ids(monkeypatch):
    loaded = load_model(EngineArgs("tiny-llama"))
    lm = loaded.served.lm
    quantize_linear_layers(lm)
    assert fuse_input_quantization(lm) == 3 * len(lm.model.layers)   # qkv and gate/up's norms, the SiLU-mul
    layer = lm.model.layers[0]
    assert layer.input_layernorm.quantize_output and layer.post_attention_layernorm.quantize_output
    assert layer.mlp.quantize_output and not lm.model.norm.quantize_output   # the LM head stays bf16/fp32
    # an engine with the fused producers samples what one without them does
    prompt = GenerationRequest(prompt="The quick brown fox", max_tokens=8, sampling=SamplingParams(temperature=0.0))
    ids = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(fp8_linear, "fuse_input_quantization", lambda model: 0)
        with Engine(EngineArgs("tiny-llama", quantization="fp8")) as engine:
            assert engine.model.lm.model.layers[0].mlp.quantize_output == fused
            ids[fused] = engine.generate([prompt])[0].token_ids
    assert len(ids[True]) == 8 and ids[True] == ids[False]


def test_fp8_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        EngineArgs("tiny-llama", quantization="int4")
    with pytest.raises(ValueError, match="not supported for whisper"):
        load_model(EngineArgs("tiny-whisper", quantization="fp8"))


def test_tiny_orpheus_loads_with_an_fp8_backbone():
    loaded = load_model(EngineArgs("tiny-orpheus", quantization="fp8"))
    assert isinstance(loaded.served.lm.model.layers[0].self_attn.qkv_proj, Fp8Linear)



def test_the_flag_reaches_engine_args_for_serve_and_bench():
    from omniwalk.bench.cli import _engine_args as bench_engine_args
    from omniwalk.cli import _engine_args, build_parser
    parser = build_parser()
    assert _engine_args(parser.parse_args(["serve", "tiny-llama", "--quantization", "fp8"])).quantization == "fp8"
    assert _engine_args(parser.parse_args(["serve", "tiny-llama"])).quantization is None
    bench = parser.parse_args(["bench", "--tts", "--model", "tiny-orpheus", "--quantization", "fp8"])
    assert bench_engine_args(bench).quantization == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "tiny-llama", "--quantization", "int8"])
