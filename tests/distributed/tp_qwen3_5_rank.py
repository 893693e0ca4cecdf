"""One rank of the Qwen3.5 tensor-parallel checks in test_tensor_parallel_qwen3_5.py (a
process of its own, joined to the others over gloo): `python tp_qwen3_5_rank.py RANK SIZE PORT`.

- a Gated DeltaNet layer split by heads, from the same seeded weights, computes what the
  unsharded layer computes (output after out_proj's all-reduce), over a ragged prefill
  batch (a piece longer than the 64-token chunk of the chunked delta rule, a one-token
  piece, a short one) and then a decode step; and its state slots hold this rank's heads'
  slice of the unsharded conv and recurrent states; the same again through the CUDA
  path's fused Triton kernels (conv decode step over the strided packed projection, the
  recurrent kernel over pool rows), run in Triton's interpreter;
- the whole model (gated attention, MLP, vocabulary-split embedding and LM head) gives the
  unsharded model's logits over one sequence;
- the seeded random init, and a checkpoint in Hugging Face's layout (in_proj_qkv/_z/_b/_a
  and q/k/v_proj apart), give every rank its slice of the one-device weights.

Exits 0 when all hold, else prints what differs and exits 1."""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: its kernels on the CPU

import torch
from safetensors.torch import save_file

from omniwalk.engine.attention import attention_for_tests
from omniwalk.engine.state_pool import StateBatch, StatePool
from omniwalk.engine.tensor_parallel import (
    TensorParallelGroup, init_tensor_parallel, set_tensor_parallel_group, tensor_parallel_group,
)
from omniwalk.models.loader import init_random_weights, load_checkpoint_weights
from omniwalk.models.qwen3_5.config import tiny_config
from omniwalk.models.qwen3_5.loading import checkpoint_name, state_pool_shape
from omniwalk.models.qwen3_5.model import GatedDeltaNet, Qwen3_5ForCausalLM
from tp_layer_rank import check, failures, hf_layout


def one_device(build):
    """`build()` as on one device (rank 0 of 1), then this process's group again."""
    previous = set_tensor_parallel_group(TensorParallelGroup())
    try:
        return build()
    finally:
        set_tensor_parallel_group(previous)


def shard_of(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    shard = getattr(param, "shard_of_full", None)
    return full if shard is None else shard(full)


def check_weights(what: str, sharded: torch.nn.Module, whole: torch.nn.Module) -> None:
    full = dict(whole.named_parameters())
    for name, param in sharded.named_parameters():
        check(f"{what} of {name}", param.data, shard_of(param, full[name].data), exact=True)


@torch.no_grad()
def check_gated_delta_net(config, lengths: list[int], what: str = "gated delta net") -> None:
    tp = tensor_parallel_group()
    whole, whole_pool = one_device(lambda: (GatedDeltaNet(config, 0), StatePool(state_pool_shape(config, 3),
                                                                                 torch.float32, "cpu")))
    init_random_weights(whole, seed=11)
    sharded = GatedDeltaNet(config, 0)
    init_random_weights(sharded, seed=11)
    check_weights("random init", sharded, whole)
    pool = StatePool(state_pool_shape(config, 3), torch.float32, "cpu")
    if pool.conv.shape[2] != config.linear_conv_dim // tp.size or pool.recurrent.shape[2] != (
            config.linear_num_value_heads // tp.size):
        failures.append(f"state pool shapes {tuple(pool.conv.shape)}, {tuple(pool.recurrent.shape)} are not per rank")
    for p in (pool, whole_pool):
        for h in range(3):
            p.allocate(h)
    g = torch.Generator().manual_seed(1)          # the same inputs on every rank
    parts = (config.linear_key_dim, config.linear_key_dim, config.linear_value_dim)
    heads = slice(*tp.shard(config.linear_num_value_heads))
    for step, step_lengths in enumerate((lengths, [1, 1, 1], [3, 1, 1])):   # prefill, decode, mixed
        x = torch.randn(sum(step_lengths), config.hidden_size, generator=g)
        expected = one_device(lambda: whole(x, StateBatch(whole_pool, [whole_pool.rows(h) for h in range(3)],
                                                          step_lengths)))
        got = sharded(x, StateBatch(pool, [pool.rows(h) for h in range(3)], step_lengths))
        check(f"{what}, step {step} {step_lengths}", got, expected)
        for p in (pool, whole_pool):
            p.commit(list(range(3)))
        for h in range(3):
            row, whole_row = pool.rows(h)[0], whole_pool.rows(h)[0]
            conv = torch.cat([part[..., slice(*tp.shard(part.shape[-2])), :] for part in
                              whole_pool.conv[:, whole_row].split(parts, dim=-2)], dim=-2)
            check(f"{what}: conv state of sequence {h} after step {step}", pool.conv[:, row], conv)
            check(f"{what}: recurrent state of sequence {h} after step {step}", pool.recurrent[:, row],
                  whole_pool.recurrent[:, whole_row, heads])


@torch.no_grad()
def full_logits(model: Qwen3_5ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    config = model.config
    pool = StatePool(state_pool_shape(config, 1), torch.float32, "cpu")
    pool.allocate(0)
    attention = attention_for_tests(len(config.full_attention_layers),
                                    config.num_kv_heads // tensor_parallel_group().size, config.head_dim, len(ids))
    hidden = model(ids, torch.arange(len(ids)), attention, StateBatch(pool, [pool.rows(0)], [len(ids)]))
    return model.compute_logits(hidden)


def perturb(model: torch.nn.Module) -> None:
    """Norm weights off their neutral values (the seeded init leaves them at it)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=g))


@torch.no_grad()
def check_model(config) -> None:
    whole = one_device(lambda: Qwen3_5ForCausalLM(config))
    init_random_weights(whole, seed=5)
    perturb(whole)
    sharded = Qwen3_5ForCausalLM(config)
    init_random_weights(sharded, seed=5)
    whole_init = one_device(lambda: Qwen3_5ForCausalLM(config))
    init_random_weights(whole_init, seed=5)
    check_weights("random init", sharded, whole_init)
    # a checkpoint in Hugging Face's layout: each packed part split by heads on its own
    with tempfile.TemporaryDirectory() as folder:
        tensors = hf_layout(whole)
        if not {"model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_a.weight",
                "model.layers.3.self_attn.q_proj.weight"} <= tensors.keys():
            failures.append("the checkpoint does not keep the packed projections apart")
        save_file(tensors, f"{folder}/model.safetensors")
        load_checkpoint_weights(sharded, folder, rename=checkpoint_name)
    check_weights("checkpoint load", sharded, whole)
    ids = torch.randint(0, config.vocab_size, (90,), generator=torch.Generator().manual_seed(3))
    expected = one_device(lambda: full_logits(whole, ids))
    check("model logits", full_logits(sharded, ids), expected)


def main(rank: int, size: int, port: int) -> int:
    init_tensor_parallel(rank, size, port, "cpu")
    config = tiny_config(512)
    check_gated_delta_net(config, [70, 1, 5])
    check_model(config)
    from omniwalk.kernels import causal_conv, triton_support
    from omniwalk.layers import gated_delta_rule
    if triton_support.triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
        causal_conv.use_triton = gated_delta_rule.use_triton = lambda x: True
        check_gated_delta_net(config, [10, 1, 5], "gated delta net, fused kernels")
    for failure in failures:
        print(f"rank {rank}: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*map(int, sys.argv[1:4])))
