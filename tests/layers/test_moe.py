"""The sparse MoE block: parity with transformers' Qwen3-Omni Thinker block, its backends,
and loading per-expert checkpoint tensors into its stacked parameters.

`-m gpu`: the CUDA backends (Triton, grouped_mm) against the torch one in bf16 at the real
Thinker's shape, and a CUDA-graph capture of the forward."""

import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from omniwalk.layers import moe  # noqa: E402
from omniwalk.layers.moe import SparseMoeBlock  # noqa: E402
from omniwalk.models.loader import load_checkpoint_weights  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_moe  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 32, 16, 8, 2


def hf_config(norm_topk_prob=True, **extra):
    config = transformers.Qwen3OmniMoeTextConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob, **extra)
    config._experts_implementation = "eager"
    return config


def random_(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return module


def block_pair(norm_topk_prob=True, seed=0):
    """transformers' block with random weights, and ours with the same state dict."""
    reference = random_(hf_moe.Qwen3OmniMoeThinkerTextSparseMoeBlock(hf_config(norm_topk_prob)), seed).eval()
    ours = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, norm_topk_prob)
    ours.load_state_dict(reference.state_dict())   # strict: the parameter names are transformers'
    return reference, ours


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_torch_backend_matches_transformers(num_tokens, norm_topk_prob):
    reference, ours = block_pair(norm_topk_prob)
    ours.backend = "torch"
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    with torch.no_grad():
        expected = reference(x[None])[0]
        got = ours(x)
    assert got.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_other_backends_match_transformers_on_cpu(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    reference, ours = block_pair(norm_topk_prob=True, seed=1)
    ours.backend = backend   # triton: in Triton's CPU interpreter
    x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x[None])[0], atol=1e-5, rtol=1e-5)


def test_the_default_backend_is_torch_on_cpu_and_triton_on_cuda(monkeypatch):
    moe.default_moe_backend.cache_clear()
    monkeypatch.delenv(moe.BACKEND_ENV, raising=False)
    try:
        assert moe.default_moe_backend("cpu") == "torch"
        assert moe.default_moe_backend("cuda") == ("triton" if moe.triton is not None else "torch")
        moe.default_moe_backend.cache_clear()
        monkeypatch.setenv(moe.BACKEND_ENV, "grouped_mm")
        assert moe.default_moe_backend("cuda") == "grouped_mm"
        assert moe.default_moe_backend("cpu") == "torch"
        moe.default_moe_backend.cache_clear()
        monkeypatch.setenv(moe.BACKEND_ENV, "cutlass")
        with pytest.raises(ValueError, match="OMNIWALK_MOE_BACKEND"):
            moe.default_moe_backend("cuda")
    finally:
        moe.default_moe_backend.cache_clear()


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match="top_k"):
        SparseMoeBlock(HIDDEN, INTERMEDIATE, num_experts=4, top_k=5, norm_topk_prob=True)


# ----------------------------------------------------------------------------- loading

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, norm_topk_prob=True)


class TinyMoeModel(nn.Module):
    """A block under a layer prefix, as a decoder holds it: `layers.1.mlp.experts...`"""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])


def per_expert_tensors(model: TinyMoeModel, seed=0) -> dict[str, torch.Tensor]:
    """Checkpoint tensors as transformers saves them: one per expert and projection."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        prefix = f"layers.{layer}.mlp"
        tensors[f"{prefix}.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=gen)
        for e in range(EXPERTS):
            for name, shape in [("gate_proj", (INTERMEDIATE, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN)),
                                ("down_proj", (HIDDEN, INTERMEDIATE))]:
                tensors[f"{prefix}.experts.{e}.{name}.weight"] = torch.randn(shape, generator=gen)
    return tensors


def save(tmp_path, tensors):
    save_file({name: t.contiguous() for name, t in tensors.items()}, tmp_path / "model.safetensors")


def test_per_expert_tensors_fill_the_stacked_parameters(tmp_path):
    model = TinyMoeModel()
    tensors = per_expert_tensors(model)
    save(tmp_path, tensors)
    assert load_checkpoint_weights(model, tmp_path) == []
    experts = model.layers[1].mlp.experts
    for e in (0, 5, EXPERTS - 1):
        assert torch.equal(experts.gate_up_proj[e, :INTERMEDIATE], tensors[f"layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(experts.gate_up_proj[e, INTERMEDIATE:], tensors[f"layers.1.mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(experts.down_proj[e], tensors[f"layers.1.mlp.experts.{e}.down_proj.weight"])
    assert torch.equal(model.layers[1].mlp.gate.weight, tensors["layers.1.mlp.gate.weight"])


def test_a_missing_expert_tensor_is_named(tmp_path):
    model = TinyMoeModel()
    tensors = per_expert_tensors(model)
    del tensors["layers.1.mlp.experts.6.up_proj.weight"]
    save(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing parameters \['layers\.1\.mlp\.experts\.6\.up_proj\.weight'\]"):
        load_checkpoint_weights(model, tmp_path)


def test_an_expert_out_of_range_is_an_error(tmp_path):
    model = TinyMoeModel()
    tensors = per_expert_tensors(model)
    tensors[f"layers.0.mlp.experts.{EXPERTS}.gate_proj.weight"] = torch.zeros(INTERMEDIATE, HIDDEN)
    save(tmp_path, tensors)
    with pytest.raises(ValueError, match=rf"experts\.{EXPERTS}\.gate_proj\.weight: expert {EXPERTS} out of range"):
        load_checkpoint_weights(model, tmp_path)


def test_an_expert_tensor_of_the_wrong_shape_is_an_error(tmp_path):
    model = TinyMoeModel()
    tensors = per_expert_tensors(model)
    tensors["layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(INTERMEDIATE, HIDDEN)   # transposed
    save(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj\.weight: checkpoint shape \(16, 32\)"):
        load_checkpoint_weights(model, tmp_path)


def test_stacked_expert_tensors_load_as_they_are(tmp_path):
    source = random_(TinyMoeModel(), seed=3)
    save(tmp_path, dict(source.state_dict()))   # names `layers.0.mlp.experts.gate_up_proj`, ...
    model = TinyMoeModel()
    load_checkpoint_weights(model, tmp_path)
    for name, param in model.state_dict().items():
        assert torch.equal(param, source.state_dict()[name]), name


def test_stacked_and_per_expert_tensors_of_one_parameter_are_refused(tmp_path):
    model = TinyMoeModel()
    tensors = per_expert_tensors(model)
    tensors["layers.0.mlp.experts.gate_up_proj"] = torch.zeros(EXPERTS, 2 * INTERMEDIATE, HIDDEN)
    save(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.gate_up_proj: .* both whole and in parts"):
        load_checkpoint_weights(model, tmp_path)


def test_a_transformers_checkpoint_loads_and_gives_transformers_outputs(tmp_path):
    """save_pretrained of a tiny Thinker text model: its MoE blocks load into ours and agree."""
    config = hf_config(intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, vocab_size=64)
    hf_model = hf_moe.Qwen3OmniMoeThinkerTextModel._from_config(config).eval()
    random_(hf_model, seed=4).save_pretrained(tmp_path)
    model = TinyMoeModel()
    skipped = load_checkpoint_weights(model, tmp_path, rename=lambda name: name if ".mlp." in name else None)
    assert "embed_tokens.weight" in skipped
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(6))
    for layer, hf_layer in zip(model.layers, hf_model.layers):
        assert torch.equal(layer.mlp.experts.gate_up_proj, hf_layer.mlp.experts.gate_up_proj)
        assert torch.equal(layer.mlp.experts.down_proj, hf_layer.mlp.experts.down_proj)
        layer.mlp.backend = "torch"
        with torch.no_grad():
            torch.testing.assert_close(layer.mlp(x), hf_layer.mlp(x[None])[0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- GPU

THINKER = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8, norm_topk_prob=True)


def thinker_block(seed=0) -> SparseMoeBlock:
    block = SparseMoeBlock(**THINKER)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return block.to("cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def cuda_block():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return thinker_block()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("num_tokens", [1, 8, 128, 1000])
def test_cuda_backends_match_the_torch_backend_in_bf16(cuda_block, backend, num_tokens):
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, THINKER["hidden_size"], generator=gen, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        cuda_block.backend = "torch"
        expected = cuda_block(x)
        cuda_block.backend = backend
        got = cuda_block(x)
    cuda_block.backend = None
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # same routing and roundings, but the reference adds the 8 expert rows one by one in bf16
    # (on CPU, grouped_mm against it at this shape: 4e-3)
    error = (got.float() - expected.float()).norm() / expected.float().norm()
    assert error < 1e-2, error
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("num_tokens", [4, 64])   # triton: masked decode tiles, then aligned blocks
def test_cuda_graph_replay_with_new_inputs_equals_eager(cuda_block, backend, num_tokens):
    cuda_block.backend = backend
    gen = torch.Generator("cuda").manual_seed(7)
    inputs = [torch.randn(num_tokens, THINKER["hidden_size"], generator=gen, device="cuda").to(torch.bfloat16)
              for _ in range(3)]
    static_x = inputs[0].clone()
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up: compile the kernels, fill the allocator
            for _ in range(2):
                cuda_block(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):   # raises on any host sync
            static_out = cuda_block(static_x)
        outputs = []
        for x in inputs[1:]:
            static_x.copy_(x)
            graph.replay()
            outputs.append(static_out.clone())
        eager = [cuda_block(x) for x in inputs[1:]]
    cuda_block.backend = None
    assert not torch.equal(outputs[0], outputs[1])   # the replays saw the new inputs
    for replayed, expected in zip(outputs, eager):
        torch.testing.assert_close(replayed, expected, atol=1e-3, rtol=1e-2)


def test_variant_token_counts_reach_every_kernel_variant_once():
    from omniwalk.kernels.fused_moe import kernel_variant, variant_token_counts

    for top_k, experts, max_tokens in ((8, 128, 8192), (6, 128, 2048), (2, 8, 300)):
        counts = variant_token_counts(top_k, experts, max_tokens)
        reached = {kernel_variant(n, top_k, experts) for n in counts}
        assert len(reached) == len(counts)   # no two counts compile the same kernels
        assert reached == {kernel_variant(n, top_k, experts) for n in range(1, max_tokens + 1)}


def test_warm_up_runs_each_block_shape_once_at_its_variant_counts():
    from omniwalk.kernels.fused_moe import variant_token_counts

    model = nn.Sequential(*(SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True) for _ in range(3)),
                          SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, 1, True))
    for block in model:
        random_(block, 0)
    seen = []
    model[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    model[1].register_forward_pre_hook(lambda _, args: seen.append(-1))
    runs = moe.warm_up_moe_kernels(model, 40)
    assert sorted(counts for counts in runs.values()) == sorted(
        [variant_token_counts(TOP_K, EXPERTS, 40), variant_token_counts(1, EXPERTS, 40)])
    assert seen == variant_token_counts(TOP_K, EXPERTS, 40)   # the first block of a shape, alone
