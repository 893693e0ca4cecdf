"""Whisper's encoder and decoder as plain torch modules, parameter names as transformers'
`WhisperForConditionalGeneration` has them (so checkpoints load by name).

    encoder:  mel [B, mels, 3000] -> GELU(conv1) -> GELU(conv2, stride 2) -> + positions
              -> pre-LN layers (self-attention, MLP) -> layer_norm -> states [B, 1500, d]
    decoder:  tokens -> embed_tokens + embed_positions -> pre-LN layers (causal
              self-attention over the paged KV cache, cross-attention over the stream's
              cross-attention slot, MLP) -> layer_norm -> logits = h @ embed_tokens^T

Queries are scaled before attention (q_proj(x) * head_dim^-0.5, then attention with
scale 1), in the order of the reference implementation, which rounds differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.engine.attention import PagedAttention
from omniwalk.engine.cross_attention import CrossAttention
from omniwalk.kernels.layer_norm import add_layer_norm
from omniwalk.layers.linear import Linear, linear
from omniwalk.models.whisper.config import WhisperConfig


def _activation(name: str):
    return {"gelu": F.gelu, "relu": F.relu}[name]


class WhisperAttention(nn.Module):
    """q, k (no bias), v, out projections; the attention itself is the caller's."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model, bias=False)
        self.v_proj = Linear(d_model, d_model)
        self.out_proj = Linear(d_model, d_model)
        self.qkv: tuple[torch.Tensor, torch.Tensor] | None = None   # (weight, bias) once fused

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """q, k and v as one GEMM (self-attention: a decode step launches 32 layers' worth of
        small GEMMs, and each costs its launch more than its bytes). One [3d, d] weight whose
        rows the three projections' parameters then view, so their names, loading and
        state_dict stay; k has no bias: zeros in the fused bias."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        d = q.weight.shape[0]
        weight = torch.cat([q.weight, k.weight, v.weight])
        bias = torch.cat([q.bias, torch.zeros_like(q.bias), v.bias])
        q.weight.data, k.weight.data, v.weight.data = weight[:d], weight[d : 2 * d], weight[2 * d :]
        q.bias.data, v.bias.data = bias[:d], bias[2 * d :]
        self.qkv = (weight, bias)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.q_proj(x) * self.scaling)

    def key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k_proj(x)), self.heads(self.v_proj(x))

    def query_key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scaled query, key and value heads of x (one GEMM once fused)."""
        if self.qkv is None:
            return (self.query(x), *self.key_value(x))
        q, k, v = linear(x, *self.qkv).chunk(3, dim=-1)
        return self.heads(q * self.scaling), self.heads(k), self.heads(v)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        d = config.d_model
        self.self_attn = WhisperAttention(d, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _activation(config.activation_function)
        self.positions = config.max_source_positions

    def forward(self, y: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it), as the decoder's layers:
        each residual add goes into the next norm (kernels/layer_norm.py); the caller adds the last y."""
        # y, h: [B * S, d]; the batch's windows are rows of one flat stream
        x, h = add_layer_norm(y, h, self.self_attn_layer_norm)
        batch = x.shape[0] // self.positions
        q, k, v = (t.view(batch, self.positions, *t.shape[1:]).transpose(1, 2)
                   for t in self.self_attn.query_key_value(x))                     # [B, H, S, D]
        attn = F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(1, 2).reshape(x.shape)
        x, h = add_layer_norm(self.self_attn.out_proj(attn), h, self.final_layer_norm)
        return self.fc2(self.act(self.fc1(x))), h


class WhisperEncoder(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features: [B, num_mel_bins, 2 * max_source_positions] -> states [B, max_source_positions, d]
        h = F.gelu(self.conv1(features))
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        # one contiguous [B * S, d] stream: the transposed layout of the convolutions' output
        # would otherwise carry through every residual add (strided elementwise kernels, ~100 us
        # each for 8 windows in the c = 32 kernel table at 31f317b)
        h = (h + self.embed_positions.weight).reshape(-1, h.shape[-1])
        y = None
        for layer in self.layers:
            y, h = layer(y, h)
        return add_layer_norm(y, h, self.layer_norm)[0].view(features.shape[0], -1, h.shape[-1])


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig, index: int):
        super().__init__()
        d = config.d_model
        self.index = index
        self.self_attn = WhisperAttention(d, config.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = WhisperAttention(d, config.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        # a decode step's rows: the GEMV kernel on CUDA (layers/linear.py)
        self.fc1 = Linear(d, config.decoder_ffn_dim)
        self.fc2 = Linear(config.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _activation(config.activation_function)

    def forward(self, y: torch.Tensor | None, h: torch.Tensor, attention: PagedAttention,
                cross: CrossAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); its input: the previous
        layer's (None at the first). Each residual add goes into the next norm (one kernel on
        CUDA: kernels/layer_norm.py); the caller adds the last y."""
        # y, h: [num_tokens, d], the flat ragged batch
        x, h = add_layer_norm(y, h, self.self_attn_layer_norm)
        q, k, v = self.self_attn.query_key_value(x)
        # a window holds at most 448 tokens (7 tiles of 64 keys): unsplit, one program per head
        # walks them, where a split decode added a merge kernel a layer (the c = 1 kernel table
        # at 7e2d9bf: 4 splits 3.6 us + merge 5.1 us a layer)
        attn = attention.forward(self.index, q, k, v, scale=1.0, max_splits=1)
        x, h = add_layer_norm(self.self_attn.out_proj(attn.flatten(1)), h, self.encoder_attn_layer_norm)
        attn = cross.forward(self.index, self.encoder_attn.query(x), scale=1.0)
        x, h = add_layer_norm(self.encoder_attn.out_proj(attn.flatten(1)), h, self.final_layer_norm)
        return self.fc2(self.act(self.fc1(x))), h


class WhisperDecoder(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        d = config.d_model
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(WhisperDecoderLayer(config, i) for i in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                cross: CrossAttention) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden [num_tokens, d]
        # no embedding scale: transformers ignores config.scale_embedding for Whisper
        h = self.embed_tokens(input_ids) + self.embed_positions(positions)
        y = None
        for layer in self.layers:
            y, h = layer(y, h, attention, cross)
        return add_layer_norm(y, h, self.layer_norm)[0]

    def cross_key_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states [n, S, d] -> cross keys, values [num_layers, n, S, heads, head_dim]."""
        pairs = [layer.encoder_attn.key_value(states) for layer in self.layers]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


class WhisperModel(nn.Module):
    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.encoder = WhisperEncoder(config)
        self.decoder = WhisperDecoder(config)


class WhisperForConditionalGeneration(nn.Module):
    """The checkpoint's module tree: `model.encoder`, `model.decoder`, and `proj_out` only
    when it is not tied to `model.decoder.embed_tokens`."""

    def __init__(self, config: WhisperConfig):
        super().__init__()
        self.config = config
        self.model = WhisperModel(config)
        if not config.tie_word_embeddings:
            self.proj_out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def fuse_projections(self) -> None:
        """q, k, v of every self-attention as one GEMM (after the weights are loaded)."""
        layers = [*self.model.encoder.layers, *self.model.decoder.layers]
        for layer in layers:
            layer.self_attn.fuse_projections()

    @property
    def encoder(self) -> WhisperEncoder:
        return self.model.encoder

    @property
    def decoder(self) -> WhisperDecoder:
        return self.model.decoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                cross: CrossAttention) -> torch.Tensor:
        """The decoder alone, as the decoder executor calls its model (the encoder is a node
        of its own): hidden [num_tokens, d]."""
        return self.decoder(input_ids, positions, attention, cross)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [rows, d] -> [rows, vocab] float32
        weight = self.model.decoder.embed_tokens.weight if self.config.tie_word_embeddings else self.proj_out.weight
        return F.linear(hidden, weight).float()
