"""Filling a model's parameters: from a local Hugging Face checkpoint, or at random.

Checkpoint tensors are matched to parameters by name (our modules use the HF names). A
parameter may carry a `weight_loader(param, tensor)` attribute to load itself differently
(a tensor-parallel shard, a fused projection); otherwise the tensor is copied in, cast to
the parameter's dtype and device.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from omniwalk.layers.norm import RMSNorm


def read_hf_config(folder: str | Path) -> dict:
    """The `config.json` of a local Hugging Face model folder, as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return json.loads(path.read_text())


def load_checkpoint_weights(model: nn.Module, folder: str | Path) -> None:
    """Copies every tensor of `folder/*.safetensors` (one file or shards) into `model`.

    Raises ValueError naming the parameters the checkpoint lacks and the checkpoint
    tensors the model has no parameter for.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if _is_skipped(model, name):
                    continue
                if name not in params:
                    unexpected.append(name)
                    continue
                if name in loaded:
                    raise ValueError(f"{name} appears in more than one checkpoint file in {folder}")
                _load_one(name, params[name], f.get_tensor(name))
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not match the model: "
            f"missing parameters {missing}, unexpected tensors {sorted(unexpected)}"
        )


def _is_skipped(model: nn.Module, name: str) -> bool:
    # Rotary frequencies are derived from the config; old checkpoints still store them.
    if "rotary_emb." in name:
        return True
    # With tied embeddings the head *is* embed_tokens; a stored copy is redundant.
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    return tied and name == "lm_head.weight"


@torch.no_grad()
def _load_one(name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    weight_loader = getattr(param, "weight_loader", None)
    if weight_loader is not None:
        weight_loader(param, tensor)
        return
    if tensor.shape != param.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}")
    param.copy_(tensor.to(param.dtype))


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Deterministic weights for tests and demos: N(0, 0.02) for matrices and embeddings,
    zeros for biases, ones for norm scales.

    Values are drawn on the CPU in fp32 from a private generator, so they depend only on
    `seed` and the model's shape: not on global RNG state, device or dtype.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if _is_norm(m)}
    for name, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
            param.copy_(values)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (RMSNorm, nn.RMSNorm, nn.LayerNorm))
