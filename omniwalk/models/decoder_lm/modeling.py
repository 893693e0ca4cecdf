"""Decoder-only transformer (Llama / Qwen3) over a flat ragged batch of tokens.

There is no batch dimension: a forward pass takes the `num_tokens` new tokens of every
sequence in the batch, concatenated, with their absolute `positions`. Which token belongs
to which sequence, and what each one may attend to, is the business of the
`PagedAttention` passed in; the modules here only see `[num_tokens, ...]` tensors.

Module and parameter names equal the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`),
so checkpoints load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.engine.attention import PagedAttention
from omniwalk.engine.tensor_parallel import tensor_parallel_group
from omniwalk.kernels.norm_rotary import QKRotary
from omniwalk.layers.config import DecoderConfig
from omniwalk.layers.mlp import GatedMLP
from omniwalk.layers.norm import RMSNorm
from omniwalk.layers.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from omniwalk.layers.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    """Grouped-query self-attention with optional per-head QK norm (Qwen3) and bias."""

    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # which KV-cache layer this module writes
        # this rank's heads (all of them on one device): tensor parallelism splits by heads,
        # so attention itself needs no collective; o_proj sums the ranks' parts
        tp_size = tensor_parallel_group().size
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        bias = config.attention_bias
        # q, k and v in one projection: one GEMM instead of three (loaded from q_proj/k_proj/v_proj)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, (config.q_size, config.kv_size, config.kv_size),
                                             bias=bias)
        # in the checkpoint's (unsharded) rows; a sharded qkv_proj keeps each part's slice
        self.packed_projections = {
            "q_proj": ("qkv_proj", 0, config.q_size),
            "k_proj": ("qkv_proj", config.q_size, config.q_size + config.kv_size),
            "v_proj": ("qkv_proj", config.q_size + config.kv_size, config.q_size + 2 * config.kv_size),
        }
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,        # [num_tokens, hidden] (or its Fp8Rows, for an FP8 qkv_proj)
        cos: torch.Tensor,      # [num_tokens, rotary_dim]
        sin: torch.Tensor,      # [num_tokens, rotary_dim]
        attention: PagedAttention,
    ) -> torch.Tensor:          # [num_tokens, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)          # strided views of one buffer
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # Qwen3 normalizes each head before the rotation; on CUDA one kernel normalizes and
        # rotates q and k and writes k and v into the cache
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm else (None, None, 0.0)
        out = attention.forward(self.layer_index, q, k, v, self.scale, QKRotary(cos, sin, *norms))   # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), with the adds deferred
    into the next norm (`add_and_norm`)."""

    # each norm feeds one projection alone: with FP8 projections the norm quantizes
    fp8_input_producers = {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp.gate_up_proj"}

    def __init__(self, config: DecoderConfig, layer_index: int, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_index)
        # a sparse-expert model brings its own (`omniwalk.layers.moe`)
        self.mlp = mlp if mlp is not None else GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attention: PagedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        # x: the previous block's output, residual: the stream before it (None at layer 0).
        # Each residual add is fused into the norm that follows it.
        if residual is None:
            residual, hidden = x, self.input_layernorm(x)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(x, residual)
        hidden = self.self_attn(hidden, cos, sin, attention)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm: HF's `model.` prefix."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: PagedAttention) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden]
        cos, sin = self.rotary_emb(positions)  # once per pass, shared by all layers
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attention)
        return self.norm.add_and_norm(x, residual)[0]


class CausalLM(nn.Module):
    """Decoder plus LM head. `forward` returns hidden states; the caller picks the rows it
    needs logits for (usually each sequence's last token) and calls `compute_logits`."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The ids `compute_logits` scores: column j is id logit_ids.start + j. A model that
        # only ever samples a few ids (Orpheus: its audio codes) narrows it to those, and the
        # LM head reads a fifth of its weights (see CausalLMExecutor: no logprobs then).
        self.logit_ids = range(config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: PagedAttention) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden: [num_tokens, hidden]
        return self.model(input_ids, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> logits: [num_rows, len(logit_ids)] fp32
        ids = self.logit_ids
        if len(ids) == self.config.vocab_size:
            return self.lm_head(hidden).float()
        if self.lm_head.split_ways > 1:   # the head's rows are split by vocabulary: not narrowed yet
            raise NotImplementedError("narrowed logit ids under tensor parallelism")
        return F.linear(hidden, self.lm_head.weight[ids.start : ids.stop]).float()
