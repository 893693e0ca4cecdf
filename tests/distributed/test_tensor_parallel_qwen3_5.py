"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) at tensor parallel size 2 on the CPU
over gloo (issue 27): the layers split by heads against the unsharded ones, two ranks
through `Engine` giving exactly the ids one device gives (the built-in tiny model and a
checkpoint written by transformers' `save_pretrained`), and the sizes it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from same_generations import assert_same_generations

from omniwalk.api import Engine, GenerationRequest
from omniwalk.engine.sampler import SamplingParams
from omniwalk.loading import EngineArgs, read_model
from omniwalk.models.qwen3_5.config import check_tensor_parallel_split
from omniwalk.tensor_parallel_ranks import CHECK_OUTPUTS_ENV

RANK_SCRIPT = Path(__file__).with_name("tp_qwen3_5_rank.py")
TOKENIZER_DIR = Path(__file__).parents[2] / "omniwalk" / "models" / "assets" / "tiny-tokenizer"


def test_sharded_layers_compute_what_the_unsharded_ones_do(run_rank_script):
    run_rank_script(RANK_SCRIPT, timeout=90)


def requests() -> list[GenerationRequest]:
    """Greedy prompts of different lengths: one past the 64-token chunk of the chunked delta
    rule (the CPU path runs a prefill piece of more than one token chunk by chunk, a one-token
    piece by the recurrent step), a one-token prompt, a few in between; logprobs on one."""
    return [GenerationRequest(prompt_token_ids=[(7 * j + 3) % 500 + 1 for j in range(150)], max_tokens=8,
                              ignore_eos=True),
            GenerationRequest(prompt="Hello there", max_tokens=9, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.0, logprobs=3)),
            GenerationRequest(prompt_token_ids=[5], max_tokens=6, ignore_eos=True),
            GenerationRequest(prompt="A much longer prompt about the weather in spring and the rain in April",
                              max_tokens=12, ignore_eos=True),
            GenerationRequest(prompt_token_ids=list(range(3, 70)), max_tokens=5, ignore_eos=True)]


def generate(engine: Engine) -> list:
    return [(r.token_ids, r.finish_reason, r.usage, r.logprobs) for r in engine.generate(requests())]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> str:
    """A tiny random Qwen3_5ForCausalLM written with save_pretrained, its weights and norms
    drawn wide enough that greedy ids vary from step to step (even head counts throughout)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3_5TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
        layer_types=["linear_attention"] * 3 + ["full_attention"], bos_token_id=None, eos_token_id=0,
        initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 1.0 if ".linear_attn.norm." in name else 0.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    folder = tmp_path_factory.mktemp("qwen3_5_tp")
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("model", ["tiny-qwen3_5", "checkpoint"])
def test_two_ranks_give_the_ids_of_one(model, request, monkeypatch):
    if model == "checkpoint":
        model = request.getfixturevalue("hf_checkpoint")
    with Engine(EngineArgs(model, device="cpu", dtype="float32")) as one:
        expected = generate(one)
    monkeypatch.setenv(CHECK_OUTPUTS_ENV, "1")   # rank 1 must emit what rank 0 emits, step by step
    with Engine(EngineArgs(model, device="cpu", dtype="float32", engine_process=True,
                           tensor_parallel_size=2)) as engine:
        assert len(engine.rank_pids) == 1
        got = generate(engine)
    assert_same_generations(got, expected)
    assert [len(g[0]) for g in got] == [8, 9, 6, 12, 5]   # exact budgets
    if model != "tiny-qwen3_5":   # weights wide enough that the ids are not one token repeated
        assert len({i for ids, *_ in got for i in ids}) > 5


def test_sizes_that_do_not_split_are_refused():
    config = read_model(EngineArgs("tiny-qwen3_5")).config
    check_tensor_parallel_split(config, 2)
    with pytest.raises(ValueError, match=r"tensor parallel size 4 does not divide num_kv_heads \(2\), "
                                         r"linear_num_key_heads \(2\)"):
        check_tensor_parallel_split(config, 4)
    with pytest.raises(ValueError, match=r"tensor parallel size 3 does not divide num_heads \(4\), "
                                         r"num_kv_heads \(2\), intermediate_size \(128\), vocab_size \(512\), "
                                         r"linear_num_key_heads \(2\), linear_num_value_heads \(4\)"):
        Engine(EngineArgs("tiny-qwen3_5", engine_process=True, tensor_parallel_size=3))   # before any process starts
