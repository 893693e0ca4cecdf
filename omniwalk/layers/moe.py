# TEMPORARY STUB (deleted before merging the moe branch)
import torch
import torch.nn.functional as F
from torch import nn


class _Experts(nn.Module):
    def __init__(self, e, i, h):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.expert_projections = {"gate_proj": ("gate_up_proj", 0, i), "up_proj": ("gate_up_proj", i, 2 * i),
                                   "down_proj": ("down_proj", 0, h)}


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size, moe_intermediate_size, num_experts, top_k, norm_topk_prob):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = _Experts(num_experts, moe_intermediate_size, hidden_size)
        self.top_k, self.norm = top_k, norm_topk_prob

    def forward(self, x):
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(logits.dtype)
        out = torch.zeros_like(x)
        for e in range(self.experts.gate_up_proj.shape[0]):
            tok, pos = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            g, u = F.linear(x[tok], self.experts.gate_up_proj[e]).chunk(2, -1)
            h = F.linear(F.silu(g) * u, self.experts.down_proj[e]) * w[tok, pos, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out
