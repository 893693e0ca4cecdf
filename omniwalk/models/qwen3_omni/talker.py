"""Qwen3-Omni's Talker: a Qwen3-MoE decoder (shared expert in every layer) that turns
projected Thinker states into codec frames, one per step.

    Thinker token embeddings --text_projection--\\
    Thinker hidden (media)   --hidden_projection-+--> inputs_embeds --> layers --> norm --> codec_head -> c0
    codec ids                --codec_embedding--/                                     |
                                                                         code_predictor: c1 .. c{G-1}

The Talker never embeds text ids: every input row is an embedding built by the caller
(`talker_prompt.py` has the prefill recipe), over a flat ragged token batch with a
`PagedAttention`, as the Thinker's language model. Positions are the Thinker's kind: one
number per token (text-only prompts, every decode step, shifted by the sequence's rope
offset) or (t, h, w) per token for a prefill whose prompt holds images.

Note: HF builds every Talker layer with the shared-expert MoE block, whatever
`mlp_only_layers` / `decoder_sparse_step` say (its decoder layer overwrites `mlp` last).

Parameter names equal transformers' `Qwen3OmniMoeTalkerForConditionalGeneration`, so a full
checkpoint's `talker.*` tensors load by name once `talker.` is stripped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.engine.attention import PagedAttention
from omniwalk.layers.linear import Linear
from omniwalk.layers.moe import SharedExpertMoeBlock
from omniwalk.layers.norm import RMSNorm
from omniwalk.models.decoder_lm.modeling import DecoderLayer
from omniwalk.models.qwen3_omni.code_predictor import (
    CodePicker, CodePredictor, FrameCodes, ResidualKV, pick_greedy, predict_frame,
)
from omniwalk.models.qwen3_omni.talker_config import TalkerConfig
from omniwalk.models.qwen3_omni.thinker import MultimodalRotary


class ResizeMLP(nn.Module):
    """Thinker width -> Talker width: linear_fc1 -> SiLU -> linear_fc2, both with bias
    (HF's `Qwen3OmniMoeTalkerResizeMLP`)."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int):
        super().__init__()
        self.linear_fc1 = Linear(in_size, intermediate_size, bias=True)
        self.linear_fc2 = Linear(intermediate_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_size] -> [..., out_size]
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(nn.Module):
    """HF's `model.` prefix: the layers, final norm, multimodal rotary and the codec embedding."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        text = config.text
        self.layers = nn.ModuleList(
            DecoderLayer(text, i, SharedExpertMoeBlock(
                text.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                config.norm_topk_prob, config.shared_expert_intermediate_size))
            for i in range(text.num_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.rotary_emb = MultimodalRotary(text.rotary_dim, text.rope_theta, config.mrope_section)
        self.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        # inputs_embeds: [num_tokens, hidden]; positions: [num_tokens] or [3, num_tokens] -> [num_tokens, hidden]
        cos, sin = self.rotary_emb(positions)
        x, residual = inputs_embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attention)
        return self.norm.add_and_norm(x, residual)[0]


class Talker(nn.Module):
    """What a checkpoint's `talker.` holds: the decoder, the two Thinker projections, the
    codec head and the code predictor.

    A step: `forward` (hidden after the final norm) -> `compute_logits` on each sequence's
    last row -> pick the first code c0 -> `predict_frame(last_hidden, c0)` -> the frame's
    codes and summed embedding; the next input row is that sum plus the step's text row
    (`talker_prompt.trailing_text`; its tts pad past the end)."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        if config.text.tie_word_embeddings:
            raise ValueError("a Talker whose codec head is tied to its codec embedding is not supported")
        self.config = config
        text = config.text
        self.model = TalkerModel(config)
        # intermediate_size of the Talker's text config is the projections' width (all its MLPs are experts)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config.code_predictor)
        self.logit_ids = range(text.vocab_size)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """inputs_embeds: [num_tokens, hidden]; positions: [num_tokens] int64, or [3, num_tokens]
        (t, h, w) for a prefill with images -> hidden after the final norm: [num_tokens, hidden]."""
        return self.model(inputs_embeds, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()   # [num_rows, vocab] fp32: the first code's logits

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """First codes (or the codec's special ids): [...] -> [..., hidden]."""
        return self.model.codec_embedding(codes)

    def project_text(self, thinker_embeds: torch.Tensor) -> torch.Tensor:
        """The Thinker's token embeddings (its layer-0 input at text rows): [..., Ht] -> [..., hidden]."""
        return self.text_projection(thinker_embeds)

    def project_hidden(self, thinker_hidden: torch.Tensor) -> torch.Tensor:
        """The Thinker's hidden state `accept_hidden_layer` at media rows: [..., Ht] -> [..., hidden]."""
        return self.hidden_projection(thinker_hidden)

    def predict_frame(self, last_hidden: torch.Tensor, first_code: torch.Tensor, pick: CodePicker = pick_greedy,
                      kv: ResidualKV | None = None) -> FrameCodes:
        """The frame of a step: last_hidden [B, hidden] (this step's `forward` rows), first_code
        [B] -> its G codes and their summed embedding (`code_predictor.predict_frame`)."""
        return predict_frame(self.code_predictor, last_hidden, first_code, self.embed_codes(first_code), pick, kv)
