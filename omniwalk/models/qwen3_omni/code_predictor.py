"""Qwen3-Omni's code predictor: the small dense decoder that fills a codec frame.

Each Talker step yields a frame's first code c0 (the Talker's head). The code predictor then
writes codes c1 .. c{G-1} of that frame autoregressively, over a sequence of its own that
starts afresh every frame:

    position:  0              1           2              ...   G-1
    input:     talker hidden  emb(c0)     emb_0(c1)      ...   emb_{G-3}(c{G-2})
    predicts:  -              c1 (head 0) c2 (head 1)    ...   c{G-1} (head G-2)
               \\---- first step: 2 tokens ----/ \\----- then one token a step -----/

`emb(c0)` is the Talker's codec embedding; code g >= 1 has its own embedding table
(`model.codec_embedding[g-1]`) and its own head (`lm_head[g-1]`). The frame's summed
embedding, emb(c0) + emb_0(c1) + ... + emb_{G-2}(c{G-1}), is the Talker's next input (plus
the next text embedding).

Why a dense buffer and not the paged cache: the sequence is at most G tokens (16 in
Qwen3-Omni), lives for one Talker step, and every frame in a batch sits at the same
positions. A [B, G] key/value buffer per layer (`ResidualKV`) needs no pages, no slot
mapping and no per-request metadata; every step has shapes fixed by B alone, so the whole
G-1 step loop of a batch can later be captured as one CUDA graph.

Parameter names equal transformers' `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`
(`model.layers.0.self_attn.q_proj.weight`, `model.codec_embedding.3.weight`, `lm_head.3.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.engine.sampler import filter_top_k_top_p
from omniwalk.kernels.norm_rotary import QKRotary, norm_rotary
from omniwalk.layers.config import DecoderConfig
from omniwalk.layers.norm import RMSNorm
from omniwalk.layers.rotary import RotaryEmbedding
from omniwalk.models.decoder_lm.modeling import DecoderLayer
from omniwalk.models.qwen3_omni.talker_config import CodePredictorConfig

#: picks a code per row from a head's logits: (logits [B, V] fp32, group g in 1 .. G-1) -> [B] int64
CodePicker = Callable[[torch.Tensor, int], torch.Tensor]


class ResidualKV:
    """Keys and values of B code-predictor sequences of at most `max_len` tokens, dense:
    [num_layers, B, max_len, num_kv_heads, head_dim] each. One per batch of frames; it can
    be reused across Talker steps (each frame overwrites positions from 0)."""

    def __init__(self, config: DecoderConfig, batch_size: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]


class ResidualStepAttention:
    """`PagedAttention`'s interface (what `DecoderAttention` calls) over a `ResidualKV`: this
    step brings `num_new` tokens of every sequence, at positions [start, start + num_new);
    the flat token batch is sequence-major ([B * num_new] rows)."""

    def __init__(self, kv: ResidualKV, start: int, num_new: int):
        if start + num_new > kv.keys.shape[2]:
            raise ValueError(f"positions up to {start + num_new} overflow a buffer of {kv.keys.shape[2]}")
        self.kv, self.start, self.num_new = kv, start, num_new

    def forward(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float, rotary: QKRotary | None = None) -> torch.Tensor:
        # query: [B * n, heads, head_dim]; key, value: [B * n, kv_heads, head_dim]
        if rotary is not None:
            query = norm_rotary(query, rotary.q_weight, rotary.eps, rotary.cos, rotary.sin, rotary.zero_centered)
            key = norm_rotary(key, rotary.k_weight, rotary.eps, rotary.cos, rotary.sin, rotary.zero_centered)
        batch, n, end = self.kv.batch_size, self.num_new, self.start + self.num_new
        keys, values = self.kv.keys[layer_index], self.kv.values[layer_index]
        keys[:, self.start:end] = key.view(batch, n, *key.shape[1:]).to(keys.dtype)
        values[:, self.start:end] = value.view(batch, n, *value.shape[1:]).to(values.dtype)
        q = query.view(batch, n, *query.shape[1:]).transpose(1, 2)          # [B, heads, n, head_dim]
        k = keys[:, :end].transpose(1, 2).to(q.dtype)                        # [B, kv_heads, end, head_dim]
        v = values[:, :end].transpose(1, 2).to(q.dtype)
        mask = None
        if n > 1:   # query i sits at position start + i and sees keys up to it
            positions = torch.arange(n, device=q.device)[:, None] + self.start
            mask = torch.arange(end, device=q.device)[None, :] <= positions
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(batch * n, *query.shape[1:])


class CodePredictorModel(nn.Module):
    """HF's `model.` prefix: the layers, final norm and the G-1 codec embedding tables."""

    def __init__(self, config: CodePredictorConfig):
        super().__init__()
        decoder = config.decoder
        self.layers = nn.ModuleList(DecoderLayer(decoder, i) for i in range(decoder.num_layers))
        self.norm = RMSNorm(decoder.hidden_size, decoder.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(decoder.rotary_dim, decoder.rope_theta, decoder.rope_scaling)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(decoder.vocab_size, decoder.hidden_size) for _ in range(config.num_code_groups - 1))

    def forward(self, inputs_embeds: torch.Tensor, start: int, kv: ResidualKV) -> torch.Tensor:
        # inputs_embeds: [B, n, hidden] at positions [start, start + n) -> hidden: [B, n, hidden]
        batch, n, hidden = inputs_embeds.shape
        positions = torch.arange(start, start + n, device=inputs_embeds.device).repeat(batch)
        cos, sin = self.rotary_emb(positions)
        attention = ResidualStepAttention(kv, start, n)
        x, residual = inputs_embeds.reshape(batch * n, hidden), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attention)
        return self.norm.add_and_norm(x, residual)[0].view(batch, n, hidden)


class CodePredictor(nn.Module):
    """The code predictor: `model` plus one head per residual code group (`lm_head[g-1]`
    predicts code g)."""

    def __init__(self, config: CodePredictorConfig):
        super().__init__()
        self.config = config
        decoder = config.decoder
        self.model = CodePredictorModel(config)
        self.lm_head = nn.ModuleList(
            nn.Linear(decoder.hidden_size, decoder.vocab_size, bias=False) for _ in range(config.num_code_groups - 1))

    def new_kv(self, batch_size: int, dtype: torch.dtype, device: torch.device | str) -> ResidualKV:
        return ResidualKV(self.config.decoder, batch_size, self.config.max_len, dtype, device)

    def forward(self, inputs_embeds: torch.Tensor, start: int, kv: ResidualKV) -> torch.Tensor:
        return self.model(inputs_embeds, start, kv)

    def compute_logits(self, hidden: torch.Tensor, group: int) -> torch.Tensor:
        """hidden: [B, hidden] -> logits of code `group` (1 .. G-1): [B, vocab] fp32."""
        return self.lm_head[group - 1](hidden).float()

    def embed_codes(self, codes: torch.Tensor, group: int) -> torch.Tensor:
        """codes of group `group` (1 .. G-1): [B] -> [B, hidden]."""
        return self.model.codec_embedding[group - 1](codes)


@dataclass(frozen=True)
class FrameCodes:
    """One Talker step's frame for B sequences."""

    codes: torch.Tensor          # [B, G] int64: the Talker's first code, then the G-1 residual codes
    summed_embeds: torch.Tensor  # [B, hidden]: the sum of all G codes' embeddings (the next Talker
                                 # input, before the text embedding is added)


def pick_greedy(logits: torch.Tensor, group: int) -> torch.Tensor:
    """argmax of each row (ties: the lowest id, as torch.argmax and HF's greedy search)."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class TopKTopPSampler:
    """Sampling as HF's code predictor samples when the Talker samples (`top_k=50, top_p=0.8`,
    temperature 1): temperature, top-k, top-p, then a draw from `generator`. A row's draw
    depends on its batch-mates (one generator for all); the engine's batch-invariant
    `Sampler` is the serving choice, this is the reference."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.8
    generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor, group: int) -> torch.Tensor:
        rows, vocab = logits.shape
        scaled = logits / self.temperature
        k = torch.full((rows, 1), min(self.top_k, vocab), dtype=torch.long, device=logits.device)
        active = torch.ones(rows, 1, dtype=torch.bool, device=logits.device)
        kept = filter_top_k_top_p(scaled, k if self.top_k > 0 else None, active,
                                  self.top_p if self.top_p < 1.0 else None, active)
        probs = torch.softmax(kept, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)


def predict_frame(code_predictor: CodePredictor, last_hidden: torch.Tensor, first_code: torch.Tensor,
                  first_embed: torch.Tensor, pick: CodePicker = pick_greedy,
                  kv: ResidualKV | None = None) -> FrameCodes:
    """One Talker step's residual loop: codes 1 .. G-1 of B frames, G-1 code-predictor passes.

    last_hidden: [B, hidden], the Talker's final-norm hidden state at the step's token (what
    its codec head read); first_code: [B] the code the Talker picked; first_embed: [B, hidden]
    its Talker codec embedding. `kv`: a buffer to reuse (`code_predictor.new_kv`).
    """
    groups = code_predictor.config.num_code_groups
    if kv is None:
        kv = code_predictor.new_kv(last_hidden.shape[0], last_hidden.dtype, last_hidden.device)
    codes, embeds = [first_code], [first_embed]
    step_inputs, start = torch.stack((last_hidden, first_embed), dim=1), 0   # [B, 2, hidden]
    for group in range(1, groups):
        hidden = code_predictor(step_inputs, start, kv)[:, -1]
        code = pick(code_predictor.compute_logits(hidden, group), group)
        codes.append(code)
        embeds.append(code_predictor.embed_codes(code, group))
        start += step_inputs.shape[1]
        step_inputs = embeds[-1][:, None]
    # one sum over the stacked embeddings, the reduction HF does (torch.cat(...).sum(1))
    return FrameCodes(codes=torch.stack(codes, dim=1), summed_embeds=torch.stack(embeds, dim=1).sum(dim=1))


__all__ = ["CodePredictor", "CodePredictorModel", "CodePicker", "FrameCodes", "ResidualKV", "ResidualStepAttention",
           "TopKTopPSampler", "pick_greedy", "predict_frame"]
