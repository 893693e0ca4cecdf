"""The family interface: one typed object per model family, registered in `registry.py`.

A family is one folder under `omniwalk/models/`. Its `ModelFamily` says how to recognise
and configure its checkpoints, what its loading does differently from the shared
pipeline (`LoaderSpec`, run by `omniwalk.loading.load_model`), which capabilities the
loaded model serves (its frontends: request -> runtime `Request` + output processor),
and its warm-up requests. The served model that `LoaderSpec.serve` builds carries the
family's graph (its walks), plan and node executors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from omniwalk.engine.tensor_parallel import tensor_parallel_group
from omniwalk.layers.config import DecoderConfig

if TYPE_CHECKING:
    from omniwalk.capabilities import Frontend
    from omniwalk.graph import Node
    from omniwalk.loading import LoadContext, LoadedModel
    from omniwalk.runtime import NodeExecutor, Request, ServedModel


def decoder_kv_layout(config: DecoderConfig) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder whose every layer attends: this rank's KV
    heads under tensor parallelism (each rank caches only the heads it computes)."""
    return config.num_layers, config.num_kv_heads // tensor_parallel_group().size, config.head_dim


@dataclass(frozen=True)
class LoaderSpec:
    """What a family's loading differs in from the shared pipeline (see omniwalk.loading).

    Every hook takes the `LoadContext` built so far; the pipeline calls them in the order
    of the fields below."""

    #: the module whose weights the checkpoint (or the seeded random init) fills
    build: Callable[[Any], Any]
    #: config, tokenizer, EOS ids and weight source; None: the shared `read_model_source`
    read_source: Callable[["LoadContext"], None] | None = None
    #: (config, checkpoint tensor name) -> parameter name, or None to skip the tensor
    rename: Callable[[Any, str], str | None] | None = None
    #: after the weights, before quantization and graph capture
    after_weights: Callable[["LoadContext"], None] | None = None
    #: allocates what must precede the KV cache into ctx.resources (and ctx.slot_resource)
    resources: Callable[["LoadContext"], None] | None = None
    #: the context a request may fill; None: the config's positions, capped by --max-model-len
    max_model_len: Callable[["LoadContext"], int] | None = None
    #: (attention layers, KV heads, head dim) of the paged KV cache
    kv_layout: Callable[[Any], tuple[int, int, int]] = decoder_kv_layout
    #: why this family cannot share KV prefixes across requests; None: it honours prefix caching
    no_prefix_caching: str | None = None
    #: the module the decode CUDA graphs capture; None: ctx.module
    decode_step: Callable[["LoadContext"], Any] | None = None
    #: whether small prefill batches are captured as CUDA graphs too
    prefill_graphs: bool = True
    #: the most sequences one prefill graph holds, padding included (at most 512); None: a
    #: step's most (--max-num-seqs, and the padding)
    prefill_graph_sequences: int | None = None
    #: the most tokens one prefill graph holds, padding included; None: a step's budget
    #: (--max-num-batched-tokens), so a wave's prefill steps replay graphs too
    prefill_graph_tokens: int | None = None
    #: the causal-conv kernel width the prefill graphs gather windows for (hybrid models)
    conv_kernel: Callable[[Any], int] | None = None
    #: the served model: graph (walks), plan and node executors over what was built
    serve: Callable[["LoadContext"], "ServedModel"] = None
    #: nodes that may run in a worker process of their own (a placement's other group,
    #: omniwalk/node_workers.py), each with how that process builds the node's executor
    #: from `read_model`'s context alone (config, source, device; the rest of the model
    #: is not loaded there); a stateful executor's per-stream calls cross too (`RemoteExecutor`)
    worker_executors: Mapping[str, Callable[["LoadContext"], "NodeExecutor"]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFamily:
    """One model family as the registry knows it."""

    name: str
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[dict], Any]
    tiny_config: Callable[[int], Any]        # the built-in `tiny-<name>`, given the tiny tokenizer's size
    loader: LoaderSpec
    #: the capabilities the loaded model serves
    frontends: Callable[["LoadedModel"], list["Frontend"]]
    #: requests run once at start on CUDA, so the first real ones compile nothing
    warmup: Callable[["LoadedModel"], list["Request"]] | None = None
    #: claims a checkpoint folder by its config.json before model types are matched (a
    #: family built on another's architecture, e.g. Orpheus on Llama)
    detect: Callable[[dict], bool] | None = None
    #: EngineArgs.quantization values its loading applies (`loading.quantize_backbone`)
    quantizations: tuple[str, ...] = ()
    #: (config, tensor parallel size) -> None, or ValueError when the model cannot be split
    #: that way; None: the family runs on one device only (tensor_parallel_size 1)
    tensor_parallel: Callable[[Any, int], None] | None = None
    #: config -> the nodes of the served model's graph, without loading it: what a placement
    #: file may name, checked before any weight loads; None: checked once the model is built
    nodes: Callable[[Any], tuple["Node", ...]] | None = None
