"""Filling a model's parameters: from a local Hugging Face checkpoint, or at random.

Checkpoint tensors are matched to parameters by name (our modules use the HF names). A
parameter may carry a `weight_loader(param, tensor, rows=None)` attribute to load itself
differently (a tensor-parallel shard: omniwalk.layers.parallel); otherwise the tensor is
copied in, cast to the parameter's dtype and device.

A module that fuses several projections into one (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`) declares `packed_projections = {"q_proj": ("qkv_proj", start, end), ...}`:
the checkpoint's `...q_proj.weight` (and `.bias`) then fills rows [start, end) of
`...qkv_proj.weight`. Start and end are rows of the unsharded packed tensor: a packed
parameter with a `weight_loader` gets `rows=(start, end)` and keeps its rank's slice of
that part (each of q, k and v split by heads on its own).

Random weights (`init_random_weights`) are drawn at a sharded parameter's `full_shape`
and cut by its `shard_of_full`: every tensor-parallel size serves the same model.

A module that stacks the weights of E experts (Mixture-of-Experts) declares
`expert_projections = {"gate_proj": ("gate_up_proj", start, end), ...}`: the checkpoint's
`<module>.<e>.gate_proj.weight` then fills `<module>.gate_up_proj[e, start:end]`. Every
expert's every projection must be there; a stacked `<module>.gate_up_proj` of the full
shape loads as it is. A stacked parameter split over tensor-parallel ranks carries an
`expert_loader(param, e, (start, end), tensor)` that keeps its slice of expert e's tensor
(start, end: rows of the unsharded expert).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from omniwalk.layers.norm import RMSNorm, ZeroCenteredRMSNorm


def read_hf_config(folder: str | Path) -> dict:
    """The `config.json` of a local Hugging Face model folder, as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return json.loads(path.read_text())


def load_checkpoint_weights(
    model: nn.Module, folder: str | Path, rename: Callable[[str], str | None] | None = None,
) -> list[str]:
    """Copies every tensor of `folder/*.safetensors` (one file or shards) into `model`.

    `rename` maps a checkpoint name to the parameter name, or to None to skip the tensor
    on purpose (a part of the checkpoint the model does not serve, such as a vision tower).
    Returns the names skipped that way. Raises ValueError naming the parameters the
    checkpoint lacks and the checkpoint tensors the model has no parameter for.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    modules = dict(model.named_modules())
    shards_expected = _packed_shards(modules, params)      # packed parameter -> checkpoint names
    shards_expected.update(_expert_shards(modules, params))
    shards_loaded: set[str] = set()
    loaded: set[str] = set()
    unexpected: list[str] = []
    skipped: list[str] = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for stored_name in f.keys():
                name = rename(stored_name) if rename is not None else stored_name
                if name is None:
                    skipped.append(stored_name)
                    continue
                if _is_skipped(model, name):
                    continue
                expert = _expert_destination(modules, params, name)
                if expert is not None:
                    target, index, start, end = expert
                    _load_expert_rows(name, params[target], index, start, end, f.get_tensor(stored_name))
                    shards_loaded.add(name)
                    continue
                packed = _packed_destination(modules, name)
                if packed is not None:
                    target, start, end = packed
                    _load_packed(name, params[target], start, end, f.get_tensor(stored_name))
                    shards_loaded.add(name)
                    continue
                if name not in params:
                    unexpected.append(name)
                    continue
                if name in loaded:
                    raise ValueError(f"{name} appears in more than one checkpoint file in {folder}")
                _load_one(name, params[name], f.get_tensor(stored_name))
                loaded.add(name)
    missing = _missing(params, loaded, shards_expected, shards_loaded, folder)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not match the model: "
            f"missing parameters {missing}, unexpected tensors {sorted(unexpected)}"
        )
    return sorted(skipped)


def _missing(params: dict[str, nn.Parameter], loaded: set[str], shards_expected: dict[str, set[str]],
             shards_loaded: set[str], folder: str | Path) -> list[str]:
    """The names the checkpoint lacks: parameters loaded neither whole (`loaded`) nor from all
    their shards, reported by the shards missing when the parameter is packed or stacked."""
    missing = sorted(set(params) - loaded - set(shards_expected))
    for target, shards in sorted(shards_expected.items()):
        found = shards & shards_loaded
        if target in loaded and found:   # whole and in parts: which one was meant?
            raise ValueError(f"{target}: checkpoint {folder} holds it both whole and in parts {sorted(found)[:3]}")
        if target not in loaded:
            missing += sorted(shards - found)
    return missing


def _packed_destination(modules: dict[str, nn.Module], name: str) -> tuple[str, int, int] | None:
    """`a.b.q_proj.weight` -> (`a.b.qkv_proj.weight`, start, end) if module `a.b` packs q_proj."""
    module_path, _, kind = name.rpartition(".")
    owner_path, _, child = module_path.rpartition(".")
    packed = getattr(modules.get(owner_path), "packed_projections", None)
    if not packed or child not in packed:
        return None
    target, start, end = packed[child]
    return f"{owner_path}.{target}.{kind}", start, end


def _packed_shards(modules: dict[str, nn.Module], params: dict[str, nn.Parameter]) -> dict[str, set[str]]:
    """Each packed parameter -> the checkpoint tensor names that fill it."""
    shards: dict[str, set[str]] = {}
    for owner_path, module in modules.items():
        prefix = f"{owner_path}." if owner_path else ""
        for child, (target, _, _) in getattr(module, "packed_projections", {}).items():
            for kind in ("weight", "bias"):
                if f"{prefix}{target}.{kind}" in params:
                    shards.setdefault(f"{prefix}{target}.{kind}", set()).add(f"{prefix}{child}.{kind}")
    return shards


def _expert_destination(modules: dict[str, nn.Module], params: dict[str, nn.Parameter],
                        name: str) -> tuple[str, int, int, int] | None:
    """`a.experts.3.gate_proj.weight` -> (`a.experts.gate_up_proj`, 3, start, end) if module
    `a.experts` stacks its experts' gate_proj into gate_up_proj. Raises on an expert index
    out of range."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or not parts[-3].isdigit():
        return None
    owner_path, index, child = ".".join(parts[:-3]), int(parts[-3]), parts[-2]
    projections = getattr(modules.get(owner_path), "expert_projections", None)
    if not projections or child not in projections:
        return None
    target, start, end = projections[child]
    target = f"{owner_path}.{target}" if owner_path else target
    num_experts = params[target].shape[0]
    if index >= num_experts:
        raise ValueError(f"{name}: expert {index} out of range, {owner_path} has {num_experts} experts")
    return target, index, start, end


def _expert_shards(modules: dict[str, nn.Module], params: dict[str, nn.Parameter]) -> dict[str, set[str]]:
    """Each stacked expert parameter -> the per-expert checkpoint tensor names that fill it."""
    shards: dict[str, set[str]] = {}
    for owner_path, module in modules.items():
        prefix = f"{owner_path}." if owner_path else ""
        for child, (target, _, _) in getattr(module, "expert_projections", {}).items():
            names = {f"{prefix}{e}.{child}.weight" for e in range(params[prefix + target].shape[0])}
            shards.setdefault(prefix + target, set()).update(names)
    return shards


@torch.no_grad()
def _load_expert_rows(name: str, param: nn.Parameter, index: int, start: int, end: int, tensor: torch.Tensor) -> None:
    expert_loader = getattr(param, "expert_loader", None)   # a tensor-parallel shard keeps its slice
    if expert_loader is not None:
        try:
            expert_loader(param, index, (start, end), tensor)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return
    expert = param[index]
    if tensor.shape[0] != end - start or tensor.shape[1:] != expert.shape[1:]:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit rows [{start}, {end}) "
                         f"of expert {index} of a parameter of shape {tuple(param.shape)}")
    expert[start:end].copy_(tensor.to(param.dtype))


def _load_packed(name: str, param: nn.Parameter, start: int, end: int, tensor: torch.Tensor) -> None:
    weight_loader = getattr(param, "weight_loader", None)
    if weight_loader is None:
        _load_rows(name, param, start, end, tensor)
        return
    try:
        weight_loader(param, tensor, rows=(start, end))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


@torch.no_grad()
def _load_rows(name: str, param: nn.Parameter, start: int, end: int, tensor: torch.Tensor) -> None:
    if tensor.shape[0] != end - start or tensor.shape[1:] != param.shape[1:]:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit rows "
                         f"[{start}, {end}) of a parameter of shape {tuple(param.shape)}")
    param[start:end].copy_(tensor.to(param.dtype))


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
        try:
            weight_loader(param, tensor)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return
    if tensor.shape != param.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}")
    param.copy_(tensor.to(param.dtype))


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, on_device: bool = False) -> None:
    """Deterministic weights for tests and demos: N(0, 0.02) for matrices and embeddings,
    zeros for biases, the neutral scale for norms (ones; zeros where the norm scales by
    `1 + weight`).

    Values are drawn on the CPU in fp32 from a private generator, so they depend only on
    `seed` and the model's shape: not on global RNG state, device or dtype. `on_device`:
    drawn on the parameters' device instead (a benchmark's tens of GB of random weights;
    the values then depend on the device too).
    """
    device = next(model.parameters()).device if on_device else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight): getattr(m, "init_weight", 1.0) for m in model.modules() if _is_norm(m)}
    for name, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(norm_weights[id(param)])
        elif name.endswith(".bias"):
            param.zero_()
        else:
            # a tensor-parallel shard draws the whole tensor and keeps its slice: the same
            # weights at every tensor-parallel size (and the generator advances alike)
            values = torch.empty(getattr(param, "full_shape", param.shape), dtype=torch.float32, device=device)
            values.normal_(0.0, 0.02, generator=generator)
            shard_of_full = getattr(param, "shard_of_full", None)
            param.copy_(values if shard_of_full is None else shard_of_full(values))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (RMSNorm, ZeroCenteredRMSNorm, nn.RMSNorm, nn.LayerNorm))
