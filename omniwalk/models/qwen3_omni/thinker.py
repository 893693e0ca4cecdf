"""The Thinker's language model: a Qwen3-MoE decoder over a flat ragged batch, with
multimodal rotary positions and media embeddings placed into the prompt.

    embed_tokens(ids)  --media rows replaced by encoder outputs-->  layers  -->  norm
                                                  deepstack: after layer i < k, the image
                                                  rows get the vision encoder's level-i features

Positions: a text token's rotary position is one number; an image patch's is three
(time, height, width) and the frequency pairs of each head take them interleaved
(t h w t h w ..., `mrope_section` says how many take h and w). When all three are equal
this is plain RoPE, so decode steps (text only) pass one position per token, shifted by
the sequence's rope offset (omniwalk.models.qwen3_omni.positions), and the decode CUDA
graphs need nothing else. A prefill chunk that holds media passes a `ChunkMedia`.

Tensor parallel (`check_tensor_parallel_split`): the language model splits as decoder_lm's
does (attention by heads, the dense MLP by rows, embedding and LM head by vocabulary) and
its experts by their intermediate dimension (`layers/moe.py`); the encoders are whole on
every rank.

Parameter names equal the Hugging Face ones of `Qwen3OmniMoeThinkerForConditionalGeneration`
(`model.layers.0.mlp.experts...`, `audio_tower.*`, `visual.*`, `lm_head.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omniwalk.engine.attention import PagedAttention
from omniwalk.engine.tensor_parallel import replicated
from omniwalk.kernels.fused_moe import ExpertRows, summed
from omniwalk.layers.moe import SparseMoeBlock
from omniwalk.layers.norm import RMSNorm
from omniwalk.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from omniwalk.layers.rotary import RotaryEmbedding
from omniwalk.models.decoder_lm.modeling import DecoderLayer
from omniwalk.models.qwen3_omni.audio_encoder import AudioEncoder
from omniwalk.models.qwen3_omni.config import ThinkerConfig
from omniwalk.models.qwen3_omni.vision_encoder import VisionEncoder


@dataclass(frozen=True)
class ChunkMedia:
    """What an eager pass's tokens take from media, on the device. Rows index the pass's
    flat token batch."""

    rope_positions: torch.Tensor | None = None   # [3, num_tokens] int64: (t, h, w) of every token
    embed_rows: torch.Tensor | None = None       # [n] int64: tokens whose embedding an encoder gave
    embeds: torch.Tensor | None = None           # [n, hidden]
    deepstack_rows: torch.Tensor | None = None   # [m] int64: image tokens
    deepstack: torch.Tensor | None = None        # [levels, m, hidden]: added after layers 0 .. levels-1


class MultimodalRotary(RotaryEmbedding):
    """cos/sin of (t, h, w) positions with interleaved sections; one position per token
    when all three are equal (plain RoPE, `RotaryEmbedding`'s frequencies)."""

    def __init__(self, rotary_dim: int, theta: float, section: tuple[int, int, int]):
        super().__init__(rotary_dim, theta)
        axis = torch.zeros(rotary_dim // 2, dtype=torch.long)   # the position (0 t, 1 h, 2 w) each pair reads
        for dim in (1, 2):
            axis[dim : section[dim] * 3 : 3] = dim
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] or [3, num_tokens] -> cos, sin: [num_tokens, rotary_dim] fp32
        if positions.dim() == 1:
            return super().forward(positions)
        freqs = positions.float().index_select(0, self.axis).T * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


class ThinkerTextModel(nn.Module):
    """HF's `model.` prefix: embedding, the layers (sparse-expert or dense MLP), final norm."""

    def __init__(self, config: ThinkerConfig):
        super().__init__()
        text = config.text
        self.embed_tokens = VocabParallelEmbedding(text.vocab_size, text.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(text, i, SparseMoeBlock(text.hidden_size, config.moe_intermediate_size, config.num_experts,
                                                 config.num_experts_per_tok, config.norm_topk_prob,
                                                 sum_in_next_norm=True)
                         if config.is_sparse(i) else None)
            for i in range(text.num_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.rotary_emb = MultimodalRotary(text.rotary_dim, text.rope_theta, config.mrope_section)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                media: ChunkMedia | None = None, capture=None) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden]. `capture` (an
        # executors.HiddenCapture): its rows' hidden states at its layer are set on it.
        x = self.embed_tokens(input_ids)
        deepstack = None
        if media is not None:
            if media.rope_positions is not None:
                positions = media.rope_positions
            if media.embed_rows is not None:
                x = x.index_copy(0, media.embed_rows, media.embeds.to(x.dtype))
            deepstack = media.deepstack
        if capture is not None and capture.layer == 0:
            capture.states = x.index_select(0, capture.rows)
        cos, sin = self.rotary_emb(positions)
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, attention)
            if capture is not None and capture.layer == index + 1 < len(self.layers):
                capture.states = _output_rows(x, residual, capture.rows)   # before deepstack, as transformers
            if deepstack is not None and index < deepstack.shape[0]:
                # x + residual is the layer's output: adding to either adds to it
                x = summed(x)
                x = x.index_add(0, media.deepstack_rows, deepstack[index].to(x.dtype))
        out = self.norm.add_and_norm(x, residual)[0]
        if capture is not None and capture.layer == len(self.layers):
            capture.states = out.index_select(0, capture.rows)
        return out


def _output_rows(x: torch.Tensor | ExpertRows, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of a layer's output x + residual, x left as it is (the next norm sums it)."""
    part = ExpertRows(x.rows.index_select(0, rows)).sum() if isinstance(x, ExpertRows) else x.index_select(0, rows)
    return part + residual.index_select(0, rows)


class Thinker(nn.Module):
    """The language model, its LM head and both media encoders: what a checkpoint's
    `thinker.` (or a thinker-only folder) holds. `forward` / `compute_logits` are the
    decoder node's step (as `CausalLM`'s); the encoder nodes call `audio_tower` and `visual`."""

    def __init__(self, config: ThinkerConfig):
        super().__init__()
        self.config = config
        self.model = ThinkerTextModel(config)
        self.lm_head = ParallelLMHead(config.text.hidden_size, config.text.vocab_size)   # full logits on every rank
        with replicated():   # the encoders run whole on every rank (the same rows on each)
            self.audio_tower = AudioEncoder(config.audio)
            self.visual = VisionEncoder(config.vision)
        self.logit_ids = range(config.text.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                media: ChunkMedia | None = None, capture=None) -> torch.Tensor:
        return self.model(input_ids, positions, attention, media, capture)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()   # [num_rows, vocab] fp32
