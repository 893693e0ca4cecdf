"""Qwen3.5 text model over a flat ragged batch: gated attention and Gated DeltaNet layers.

    layer_types:  [ linear, linear, linear, full, linear, linear, linear, full, ... ]
    full:    gated attention    -> paged KV cache (KV-cache layer = rank among full layers)
    linear:  Gated DeltaNet     -> a state slot  (state-pool layer = rank among linear layers)

As in `omniwalk.models.decoder_lm.modeling` there is no batch dimension: a pass takes the new
tokens of every sequence concatenated. Attention layers see the batch through the
`PagedAttention`, recurrent layers through the `StateBatch` (which tokens belong to which
sequence, and each sequence's states). Module and parameter names equal transformers'
(`model.layers.0.linear_attn.out_proj.weight`), so checkpoints load by name, except the
projections packed into one GEMM (`packed_projections`: in_proj_qkv/_z/_b/_a -> in_proj,
q/k/v_proj -> qkv_proj), which the loader fills row range by row range.

Norms scale by `1 + weight` (ZeroCenteredRMSNorm), except the gated output norm of the
DeltaNet, which scales by `weight`.

Tensor parallel (`omniwalk.layers.parallel`): both mixers split by heads, so neither needs a
collective before its output projection (row-parallel, one all-reduce). Gated attention: a
rank holds H/N query heads with their gates and KV/N KV heads. Gated DeltaNet: a rank holds
V/N value heads and the K/N key heads they read (transformers repeats each key head for
V/K consecutive value heads, so a contiguous block of value heads reads a contiguous block
of key heads), with their rows of q, k, v, z, b and a, their conv channels, A_log and
dt_bias; its state slots hold only those heads' channels and states. The gated output norm
normalizes within a head: nothing to reduce across ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from omniwalk.engine.attention import PagedAttention
from omniwalk.engine.state_pool import StateBatch
from omniwalk.engine.tensor_parallel import tensor_parallel_group
from omniwalk.kernels.causal_conv import causal_conv1d_decode, ragged_causal_conv1d
from omniwalk.kernels.norm_rotary import QKRotary
from omniwalk.kernels.state_rows import StateRows
from omniwalk.layers.gated_delta_rule import gated_delta_rule_decode, gated_delta_rule_varlen
from omniwalk.layers.mlp import GatedMLP
from omniwalk.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm
from omniwalk.layers.parallel import (
    ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, shard_rows,
)
from omniwalk.layers.rotary import RotaryEmbedding
from omniwalk.models.qwen3_5.config import LINEAR_ATTENTION, Qwen3_5Config


def _packing(widths: dict[str, int], target: str) -> dict[str, tuple[str, int, int]]:
    """`packed_projections` (see `omniwalk.models.loader`): each checkpoint projection's rows
    in the packed `target`, in order."""
    packing, start = {}, 0
    for name, width in widths.items():
        packing[name] = (target, start, start + width)
        start += width
    return packing


class GatedAttention(nn.Module):
    """GQA with per-head QK norm, partial rotary, and a sigmoid output gate per channel.

    q_proj emits, per head, the query and its gate side by side:

        q_proj(x):  [ q_0 (head_dim) | gate_0 (head_dim) | q_1 | gate_1 | ... ]
        out = o_proj(attention(q, k, v) * sigmoid(gate))
    """

    def __init__(self, config: Qwen3_5Config, cache_layer: int):
        super().__init__()
        self.cache_layer = cache_layer      # which KV-cache layer this module writes
        # this rank's heads (all of them on one device): a contiguous block of q_proj's rows
        # is whole heads with their gates, as k_proj's and v_proj's are whole KV heads
        tp_size = tensor_parallel_group().size
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        bias = config.attention_bias
        # q (+ its gate), k and v in one projection (loaded from q_proj/k_proj/v_proj); the
        # packing in the checkpoint's (unsharded) rows, each part split on its own
        full_splits = (2 * config.q_size, config.kv_size, config.kv_size)
        self.splits = [size // tp_size for size in full_splits]
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, full_splits, bias=bias)
        self.packed_projections = _packing({"q_proj": full_splits[0], "k_proj": full_splits[1],
                                            "v_proj": full_splits[2]}, "qkv_proj")
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttention) -> torch.Tensor:
        # x: [num_tokens, hidden]; cos, sin: [num_tokens, rotary_dim]
        num_tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # per-head zero-centered norm, then rotary on the first rotary_dim dims; on CUDA one
        # kernel for q and k, with the cache write
        rotary = QKRotary(cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, zero_centered=True)
        out = attention.forward(self.cache_layer, q, k, v, self.scale, rotary)               # [tokens, heads, head_dim]
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule (`omniwalk.layers.gated_delta_rule`).

        x -> in_proj_qkv -> short causal conv + SiLU -> q | k | v        (conv state)
        x -> in_proj_b -> beta = sigmoid(b)                              write strength per head
        x -> in_proj_a -> g = -exp(A_log) * softplus(a + dt_bias)        log decay per head
                          (both computed by `omniwalk.layers.gated_delta_rule`, inside
                          the recurrent kernel on CUDA)
        delta rule(q, k, v, g, beta)                                     (recurrent state)
        -> norm(., gate = in_proj_z(x)) -> out_proj

    A decode batch (one token per sequence) runs one batched recurrent step; a batch with
    prefill pieces runs the conv and the delta rule over the whole ragged batch at once
    (decode tokens are sequences of length 1 there).
    """

    def __init__(self, config: Qwen3_5Config, state_layer: int):
        super().__init__()
        self.state_layer = state_layer      # which state-pool layer this module reads and writes
        # this rank's heads (all of them on one device): V/N value heads and the K/N key
        # heads they read; every per-head thing below is this rank's share
        tp_size = tensor_parallel_group().size
        self.num_k_heads = config.linear_num_key_heads // tp_size
        self.num_v_heads = config.linear_num_value_heads // tp_size
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        kernel = config.linear_conv_kernel_dim
        # the four input projections in one GEMM (loaded from in_proj_qkv/_z/_b/_a), q, k
        # and v split on their own: a rank's rows are [its q | its k | its v | its z | its b | its a]
        full_qkv = (config.linear_key_dim, config.linear_key_dim, config.linear_value_dim)
        full_heads = config.linear_num_value_heads
        self.splits = [conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.in_proj = ColumnParallelLinear(config.hidden_size, (*full_qkv, config.linear_value_dim, full_heads,
                                                                 full_heads), bias=False)
        self.packed_projections = _packing({"in_proj_qkv": sum(full_qkv), "in_proj_z": config.linear_value_dim,
                                            "in_proj_b": full_heads, "in_proj_a": full_heads}, "in_proj")
        # depthwise; only its weight [conv_dim, 1, kernel] is used, by the conv functions;
        # a rank's channels are its q, k and v channels
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, padding=kernel - 1, bias=False)
        shard_rows(self.conv1d.weight, full_qkv)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        shard_rows(self.dt_bias, (full_heads,))
        shard_rows(self.A_log, (full_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)   # per head: the same on every rank
        self.out_proj = RowParallelLinear(config.linear_value_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, states: StateBatch) -> torch.Tensor:  # x: [num_tokens, hidden]
        num_tokens = x.shape[0]
        # mixed [tokens, conv_dim], z [tokens, value_dim], b, a [tokens, v_heads]: strided views
        # of one buffer; a and b are the decay and write-strength inputs
        mixed, z, b, a = self.in_proj(x).split(self.splits, dim=-1)

        q, k, v = self._convolve(mixed, states.conv(self.state_layer), states)
        q = q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        recurrent = states.recurrent(self.state_layer)
        if states.all_decode:   # one token per sequence: one batched recurrent step
            core = gated_delta_rule_decode(q, k, v, a, b, self.A_log, self.dt_bias, recurrent)
        else:
            core = gated_delta_rule_varlen(q, k, v, a, b, self.A_log, self.dt_bias, recurrent, states.ragged)

        z = z.view(num_tokens, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(core, z).reshape(num_tokens, self.value_dim))

    def _convolve(self, mixed: torch.Tensor, conv_state: StateRows, states: StateBatch):
        """Short causal conv + SiLU of each sequence's new tokens [tokens, conv_dim], from its
        carried state (new states written to the pool); returns q, k, v [tokens, key/value dim]."""
        weight = self.conv1d.weight.squeeze(1)
        parts = (self.key_dim, self.key_dim, self.value_dim)
        if states.all_decode:   # q, k, v come out contiguous: the recurrent kernel reads them as they are
            return causal_conv1d_decode(mixed, weight, conv_state, parts)
        out, new_state = ragged_causal_conv1d(mixed, weight, conv_state.gather(), *states.ragged.conv_indices)
        conv_state.scatter(new_state)
        return out.split(parts, dim=-1)


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm block: x + mixer(norm(x)), then x + mlp(norm(x)), with the adds deferred
    into the next norm; the mixer is `linear_attn` (Gated DeltaNet) or `self_attn` (gated
    attention)."""

    def __init__(self, config: Qwen3_5Config, layer_index: int):
        super().__init__()
        self.is_linear = config.layer_types[layer_index] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, config.linear_attention_layers.index(layer_index))
        else:
            self.self_attn = GatedAttention(config, config.full_attention_layers.index(layer_index))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttention, states: StateBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # x: the previous block's output, residual: the stream before it (None at layer 0);
        # each residual add is fused into the norm that follows it.
        if residual is None:
            residual, hidden = x, self.input_layernorm(x)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(x, residual)
        hidden = self.linear_attn(hidden, states) if self.is_linear else self.self_attn(hidden, cos, sin, attention)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5Model(nn.Module):
    """Embedding, the layer stack and the final norm: HF's `model.` prefix."""

    def __init__(self, config: Qwen3_5Config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: PagedAttention, states: StateBatch) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attention, states)
        return self.norm.add_and_norm(x, residual)[0]


class Qwen3_5ForCausalLM(nn.Module):
    """The text model plus LM head. `forward` returns hidden states [num_tokens, hidden];
    `compute_logits` turns the rows the caller picks into fp32 logits."""

    def __init__(self, config: Qwen3_5Config):
        super().__init__()
        self.config = config
        self.model = Qwen3_5Model(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)   # the full logits on every rank
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: PagedAttention, states: StateBatch) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden: [num_tokens, hidden]
        return self.model(input_ids, positions, attention, states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> logits: [num_rows, vocab] fp32
        return self.lm_head(hidden).float()
