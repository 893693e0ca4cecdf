"""One rank of the parallel-layer checks in test_tensor_parallel.py (a process of its own,
joined to the others over gloo): `python tp_layer_rank.py RANK SIZE PORT`. Each sharded
layer, loaded from full tensors, must compute what the unsharded torch op computes; the
seeded random init and a checkpoint in Hugging Face's layout must give every rank its
slice of the one-device weights; the MoE blocks split by the experts' intermediate dimension
compute what the whole block computes, on every backend. Exits 0
when all hold, else prints what differs and exits 1."""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from omniwalk.engine.tensor_parallel import (
    TensorParallelGroup, init_tensor_parallel, replicated, set_tensor_parallel_group, tensor_parallel_group,
)
from omniwalk.layers.moe import SharedExpertMoeBlock, SparseMoeBlock
from omniwalk.layers.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from omniwalk.models.decoder_lm import CausalLM
from omniwalk.models.decoder_lm.config import llama_tiny_config, qwen3_tiny_config
from omniwalk.models.loader import init_random_weights, load_checkpoint_weights

failures: list[str] = []


def check(what: str, got: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> None:
    ok = torch.equal(got, expected) if exact else torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    if got.shape != expected.shape or not ok:
        failures.append(f"{what}: {tuple(got.shape)} vs {tuple(expected.shape)}")


def load(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    param.weight_loader(param, full)


def hf_layout(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights as a Hugging Face checkpoint names them: packed projections apart."""
    tensors = {}
    modules = dict(model.named_modules())
    for name, tensor in model.state_dict().items():
        owner, _, rest = name.rpartition(".")   # rest: weight or bias
        path, _, target = owner.rpartition(".")
        packed = getattr(modules.get(path), "packed_projections", {})
        parts = {child: (start, end) for child, (t, start, end) in packed.items() if t == target}
        if parts:
            tensors.update({f"{path}.{child}.{rest}": tensor[start:end].clone() for child, (start, end) in parts.items()})
        elif not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            tensors[name] = tensor.clone()
    return tensors


def check_moe_split(generator: torch.Generator) -> None:
    """The MoE blocks split by the experts' intermediate dimension (the router whole, a shared
    expert split by rows; one all-reduce) against the same block built whole, on every
    backend; per-expert checkpoint tensors and the seeded random init give each rank its slice."""
    for shared in (False, True):
        def block():
            return (SharedExpertMoeBlock(32, 16, 4, 2, True, shared_expert_intermediate_size=24) if shared
                    else SparseMoeBlock(32, 16, 4, 2, True))
        what = "shared-expert MoE" if shared else "sparse MoE"
        sharded = block()
        with replicated():
            whole = block()
        # weights of std 0.3: outputs of order 1, so a tolerance of 1e-5 tells a missing part
        full = {name: 0.3 * torch.randn(param.shape, generator=generator) for name, param in whole.named_parameters()}
        whole.load_state_dict(full)
        for name, param in sharded.named_parameters():
            loader = getattr(param, "weight_loader", None)
            loader(param, full[name]) if loader is not None else param.data.copy_(full[name])   # stacked: whole tensors
        if sharded.experts.gate_up_proj.shape != (4, 2 * 16 // tensor_parallel_group().size, 32):
            failures.append(f"{what}: gate_up_proj of shape {tuple(sharded.experts.gate_up_proj.shape)}")
        x = torch.randn(7, 32, generator=generator)
        for backend in ("torch", "grouped_mm", "triton"):   # triton: in Triton's CPU interpreter
            sharded.backend = whole.backend = backend
            with torch.no_grad():
                got, expected = sharded(x), whole(x)
            if expected.abs().max() < 0.1:
                failures.append(f"{what}: outputs too small to compare ({expected.abs().max():.3g})")
            check(f"{what}, {backend} backend", got, expected)
        # a checkpoint with one tensor per expert and projection, as Hugging Face stores them
        experts, intermediate = full["experts.gate_up_proj"], 16
        tensors = {name: tensor for name, tensor in full.items() if not name.startswith("experts.")}
        for e in range(4):
            tensors[f"experts.{e}.gate_proj.weight"] = experts[e, :intermediate].clone()
            tensors[f"experts.{e}.up_proj.weight"] = experts[e, intermediate:].clone()
            tensors[f"experts.{e}.down_proj.weight"] = full["experts.down_proj"][e].clone()
        if shared:   # the shared expert's gate and up rows apart, too
            packed = tensors.pop("shared_expert.gate_up_proj.weight")
            tensors["shared_expert.gate_proj.weight"], tensors["shared_expert.up_proj.weight"] = packed.chunk(2)
        with tempfile.TemporaryDirectory() as folder:
            save_file(tensors, f"{folder}/model.safetensors")
            loaded = block()
            load_checkpoint_weights(loaded, folder)
        for (name, param), reference in zip(loaded.named_parameters(), sharded.parameters()):
            check(f"{what}: checkpoint load of {name}", param.data, reference.data, exact=True)
        # seeded random init: this rank's slice of the whole block's weights, bit for bit
        init_random_weights(sharded, seed=3)
        init_random_weights(whole, seed=3)
        whole_params = dict(whole.named_parameters())
        for name, param in sharded.named_parameters():
            shard = getattr(param, "shard_of_full", None)
            full_param = whole_params[name].data
            check(f"{what}: random init of {name}", param.data, full_param if shard is None else shard(full_param),
                  exact=True)


def main(rank: int, size: int, port: int) -> int:
    init_tensor_parallel(rank, size, port, "cpu")
    tp = tensor_parallel_group()
    mine = lambda length: slice(*tp.shard(length))   # noqa: E731
    g = torch.Generator().manual_seed(0)             # the same tensors on every rank
    x = torch.randn(5, 32, generator=g)

    # column parallel, packed q (16 rows), k (8), v (8): each part split on its own
    w, b = torch.randn(32, 32, generator=g), torch.randn(32, generator=g)
    column = ColumnParallelLinear(32, (16, 8, 8), bias=True)
    load(column.weight, w), load(column.bias, b)
    expected = torch.cat([part[:, mine(part.shape[1])] for part in F.linear(x, w, b).split((16, 8, 8), -1)], -1)
    check("column parallel", column(x), expected)
    packed = ColumnParallelLinear(32, (16, 8, 8), bias=True)
    for start, end in ((0, 16), (16, 24), (24, 32)):   # q_proj, k_proj, v_proj loaded one by one
        packed.weight.weight_loader(packed.weight, w[start:end], rows=(start, end))
        packed.bias.weight_loader(packed.bias, b[start:end], rows=(start, end))
    check("column parallel, packed parts", packed.weight, column.weight, exact=True)
    check("column parallel, packed bias", packed.bias, column.bias, exact=True)

    # row parallel: the input is this rank's slice; all-reduce, bias once
    w, b = torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    row = RowParallelLinear(32, 24, bias=True)
    load(row.weight, w)
    row.bias.data.copy_(b)
    check("row parallel", row(x[:, mine(32)]), F.linear(x, w, b))

    # vocab-parallel embedding: ids of every rank's rows
    table = torch.randn(64, 16, generator=g)
    embedding = VocabParallelEmbedding(64, 16)
    load(embedding.weight, table)
    ids = torch.tensor([0, 1, 31, 32, 33, 63, 5, 40])
    check("vocab-parallel embedding", embedding(ids), F.embedding(ids, table))

    # LM head: the full logits on every rank
    head = ParallelLMHead(16, 64)
    load(head.weight, table)
    hidden = torch.randn(3, 16, generator=g)
    check("parallel LM head", head(hidden), F.linear(hidden, table))

    # seeded random init: this rank's slice of the one-device weights, bit for bit
    for tiny in (qwen3_tiny_config, llama_tiny_config):
        config = tiny(512)
        sharded = CausalLM(config)
        init_random_weights(sharded, seed=3)
        previous = set_tensor_parallel_group(TensorParallelGroup())
        whole = CausalLM(config)
        init_random_weights(whole, seed=3)
        set_tensor_parallel_group(previous)
        full = dict(whole.named_parameters())
        for name, param in sharded.named_parameters():
            shard = getattr(param, "shard_of_full", None)
            check(f"random init of {name}", param.data, full[name].data if shard is None else shard(full[name].data),
                  exact=True)
    # a checkpoint in Hugging Face's layout (q/k/v and gate/up apart): each packed part is
    # split by heads or rows on its own, whole tensors by their rows or columns
    for tiny in (qwen3_tiny_config, llama_tiny_config):
        config = tiny(512)
        previous = set_tensor_parallel_group(TensorParallelGroup())
        whole = CausalLM(config)
        init_random_weights(whole, seed=5)
        set_tensor_parallel_group(previous)
        with tempfile.TemporaryDirectory() as folder:
            tensors = hf_layout(whole)
            if not {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= tensors.keys():
                failures.append("the checkpoint does not keep q/k/v and gate/up apart")
            save_file(tensors, f"{folder}/model.safetensors")
            sharded = CausalLM(config)
            load_checkpoint_weights(sharded, folder)
        full = dict(whole.named_parameters())
        for name, param in sharded.named_parameters():
            shard = getattr(param, "shard_of_full", None)
            check(f"checkpoint load of {name}", param.data,
                  full[name].data if shard is None else shard(full[name].data), exact=True)
    check_moe_split(g)
    for failure in failures:
        print(f"rank {rank}: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*map(int, sys.argv[1:4])))
