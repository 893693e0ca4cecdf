"""Turn a model name (built-in or local Hugging Face folder) into a served model: one
loading pipeline for every family.

    load_model(args)
      read_model       (files only; the API process of an engine process runs just this)
        family, folder a built-in name (`tiny-<family>`) or a folder's config.json -> registry
        read_source    config, tokenizer, EOS ids, random or checkpoint weights, `source`
      build            the family's module on the device in the dtype, weights filled
      after_weights    what must precede graph capture (Orpheus: the sampled id range)
      quantize         --quantization, where the family takes it
      resources        what must precede the KV cache, which takes the GPU memory left
                       (recurrent-state slots, cross-attention slots, codec graphs)
      kv cache         paged, prefix caching on unless off or the family cannot share prefixes
      graphs           decode CUDA graphs, then small-prefill graphs (CUDA, not --enforce-eager)
      serve            the family's served model: graph, walks, plan, node executors
      frontends        the capabilities it serves (omniwalk.capabilities), bound by the Engine

A family supplies only what differs, in its `LoaderSpec` (omniwalk.models.family).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import KVCacheShape, PagedKVCache
from omniwalk.engine.tensor_parallel import tensor_parallel_group
from omniwalk.layers.moe import warm_up_moe_kernels
from omniwalk.models.loader import init_random_weights, load_checkpoint_weights, read_hf_config
from omniwalk.tokenizer import NoTokenizer, has_tokenizer_files, load_tokenizer

if TYPE_CHECKING:
    from omniwalk.capabilities import Frontend
    from omniwalk.models.family import ModelFamily
    from omniwalk.placement import Placement
    from omniwalk.runtime import Request, ServedModel

logger = logging.getLogger(__name__)


QUANTIZATIONS = (None, "fp8")


@dataclass(frozen=True)
class EngineArgs:
    """How to load and run one model. Validated once here; nothing writes back into it."""

    model: str = "tiny-qwen3"
    dtype: str = "auto"                 # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                # auto: cuda if available
    load_format: str = "auto"           # auto: weights from the folder; dummy: random at its shape
    seed: int = 0                       # random weights and the seeds of unseeded requests
    page_size: int = 16
    kv_cache_tokens: int | None = None  # None: 65536 on CPU, from free memory on GPU
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None    # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queue: int = 1024
    enforce_eager: bool = False         # CUDA only: no CUDA graphs for decode
    enable_prefix_caching: bool = True  # share the KV pages of common prompt prefixes
    codec: str | None = None            # TTS checkpoints: local codec folder (Orpheus: SNAC); None: <model>/snac
    quantization: str | None = None     # fp8: the decoder's projections in FP8 (layers/fp8_linear.py)
    burst_window_ms: float = 2.0        # idle engine woken by a request: gather arrivals this close together
    startup_warmup: bool | None = None  # run the model's warm-up requests at start; None: on CUDA
    engine_process: bool = False        # the engine loop (model, device) in a process of its own;
                                        # `omniwalk serve` turns it on (--no-engine-process: a thread)
    tensor_parallel_size: int = 1       # ranks (processes, one device each) that split the model;
                                        # > 1: the engine process is rank 0 (omniwalk/tensor_parallel_ranks.py)
    #: which nodes run in which worker group (omniwalk/placement.py; `--placement FILE`); None:
    #: every node here, split tensor_parallel_size ways (`Placement.default`). Its first group's
    #: size is tensor_parallel_size; its other groups run in worker processes (node_workers.py)
    placement: "Placement | None" = None
    #: a Ray cluster (`--ray-address`, as `ray.init` takes it: host:port, or auto): the
    #: placement's worker groups run as Ray actors there (omniwalk/ray_workers.py); None:
    #: as processes of this host, and Ray is never imported
    ray_address: str | None = None

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError("kv_cache_tokens must hold at least one page")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not 0 <= self.burst_window_ms <= 100:
            raise ValueError(f"burst_window_ms must be in [0, 100], got {self.burst_window_ms}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and not self.engine_process:
            raise ValueError("tensor_parallel_size > 1 needs the engine process (engine_process=True; not "
                             "--no-engine-process): it is rank 0 and starts the other ranks")
        if self.tensor_parallel_size > 1 and self.quantization is not None:
            raise ValueError("--quantization is not supported with tensor_parallel_size > 1 yet")
        if self.placement is not None:
            self._check_placement(self.placement)
        if self.ray_address is not None:
            self._check_ray_address()
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS[1:])} or None, "
                             f"got {self.quantization!r}")

    @classmethod
    def from_flags(cls, flags: Any, skip: tuple[str, ...] = ()) -> "EngineArgs":
        """The fields the CLI's flags name (`--max-num-seqs` -> max_num_seqs, ...), but those in
        `skip`: `--placement FILE` read (its errors name the file's line) and reconciled with
        `--tensor-parallel-size` (None: not given) and `--device`."""
        from omniwalk.placement import engine_flags, load_placement

        fields = {name: getattr(flags, name) for name in cls.__dataclass_fields__
                  if hasattr(flags, name) and name not in skip}
        if fields.get("placement") is not None:
            fields["placement"] = load_placement(fields["placement"])
            fields["tensor_parallel_size"], fields["device"] = engine_flags(
                fields["placement"], fields.get("tensor_parallel_size"), fields.get("device", cls.device))
        if fields.get("tensor_parallel_size") is None:
            fields.pop("tensor_parallel_size", None)
        return cls(**fields)

    def _check_placement(self, placement: "Placement") -> None:
        engine = placement.engine_group
        if engine.tensor_parallel_size != self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} but the placement's group "
                             f"{engine.name!r} has tensor_parallel_size {engine.tensor_parallel_size} "
                             f"(omniwalk.placement.engine_flags resolves the two)")
        if placement.worker_groups and not self.engine_process:
            raise ValueError("a placement with worker groups needs the engine process (engine_process=True; not "
                             "--no-engine-process): it starts and drives the workers")

    def _check_ray_address(self) -> None:
        import importlib.util   # find_spec: whether Ray is installed, without importing it

        if not self.ray_address.strip():
            raise ValueError("--ray-address is empty: give the Ray cluster's address (host:port, or auto)")
        # (worker groups need the engine process already: `_check_placement`)
        if self.placement is None or not self.placement.worker_groups:
            raise ValueError("--ray-address runs a placement's worker groups as Ray actors: it needs --placement "
                             "FILE with a group besides the engine's (docs/placement.md)")
        if importlib.util.find_spec("ray") is None:
            raise ValueError("--ray-address needs Ray, which is not installed: pip install 'omniwalk[ray]'")

    @property
    def resolved_placement(self) -> "Placement":
        """The placement this engine runs: the file's, or the default (every node here)."""
        from omniwalk.placement import Placement

        return self.placement or Placement.default(self.tensor_parallel_size, self.device)


@dataclass
class LoadedModel:
    """A model ready to serve, with what the API layer needs to know about it.

    `served` (graph, plan, executors, the weights on the device) exists only where the
    engine loop runs: in the engine process, the API process holds everything else, which
    is all its frontends need (`frontends()`)."""

    name: str
    config: Any                           # the family's config of its main module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]
    random_weights: bool
    family: "ModelFamily | None"
    kv_capacity_tokens: int               # tokens the paged KV cache holds (prompt + output budget checks)
    source: dict[str, Any] = field(default_factory=dict)   # LoadContext.source: read from the files, device-free
    served: "ServedModel | None" = None   # graph, plan, executors (the runtime's view); None away from the model

    def frontends(self) -> list["Frontend"]:
        """The capabilities it serves, bound to what is loaded (its tokenizer, context, EOS ids)."""
        return [] if self.family is None else list(self.family.frontends(self))

    def warmup_requests(self) -> list["Request"]:
        """The family's warm-up requests (none where it declares none); needs `served`."""
        if self.family is None or self.family.warmup is None:
            return []
        return self.family.warmup(self)


@dataclass
class LoadContext:
    """What the pipeline has built so far; each `LoaderSpec` hook reads it and adds its part."""

    args: EngineArgs
    family: "ModelFamily"
    folder: Path | None                   # None: the built-in tiny model
    device: torch.device
    dtype: torch.dtype
    config: Any = None
    tokenizer: object = None
    eos_token_ids: frozenset[int] = frozenset()
    random_weights: bool = True
    #: what `read_source` found beside config, tokenizer and EOS ids that the frontends use
    #: (Orpheus: token layout, codec config; Whisper: generation config, log-mel features);
    #: read from files, never on the device: the API process reads it too (engine in its own process)
    source: dict[str, Any] = field(default_factory=dict)
    module: torch.nn.Module | None = None     # the module whose weights the checkpoint fills
    resources: dict[str, Any] = field(default_factory=dict)   # allocated before the KV cache
    slot_resource: Any = None             # per-stream slots the decode graphs bind (state pool, cross-attention)
    max_model_len: int = 0
    cache: PagedKVCache | None = None
    decode_graphs: DecodeGraphs | None = None
    prefill_graphs: Any = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def read_model(args: EngineArgs) -> LoadContext:
    """Steps 1-2 of loading: the family, then config, tokenizer, EOS ids and what else the
    files say (`LoaderSpec.read_source`). Reads files only, so the API process of an engine
    in its own process runs it too, for its frontends; a bad model name fails here."""
    family, folder = resolve_family(args)
    device = resolve_device(args.device)
    ctx = LoadContext(args, family, folder, device, resolve_dtype(args.dtype, device))
    (family.loader.read_source or read_model_source)(ctx)
    if _splits(args):
        try:
            family.tensor_parallel(ctx.config, args.tensor_parallel_size)
        except ValueError as exc:
            raise ValueError(f"{args.model}: {exc}") from None
    if args.placement is not None:
        check_placement(args.placement, ctx)
    return ctx


def resolve_family(args: EngineArgs):
    """Step 1 of loading: (the model's family, its folder or None for a built-in); ValueError
    for a name that is neither, or flags its family does not take. Cheap (a config.json at
    most): what a process that loads nothing itself checks first."""
    from omniwalk.models.registry import BUILTIN_MODELS, FAMILIES, family_for_hf_config

    if args.model in BUILTIN_MODELS:
        family, folder = FAMILIES[BUILTIN_MODELS[args.model]], None
    elif Path(args.model).is_dir():
        folder = Path(args.model)
        family = family_for_hf_config(read_hf_config(folder))
    else:
        raise ValueError(f"unknown model {args.model!r}: not a built-in ({', '.join(sorted(BUILTIN_MODELS))}) "
                         f"and not a local checkpoint folder")
    if args.quantization is not None and args.quantization not in family.quantizations:
        raise ValueError(f"--quantization {args.quantization} is not supported for {family.name} models "
                         f"(supported: {', '.join(family.quantizations) or 'none'})")
    if _splits(args) and family.tensor_parallel is None:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: {family.name} models run on "
                         f"one device only (tensor parallel: {', '.join(tensor_parallel_families()) or 'none'})")
    return family, folder


def _splits(args: EngineArgs) -> bool:
    """-tp N alone; with a placement file, its checks say what splits."""
    return args.tensor_parallel_size > 1 and args.placement is None


def check_placement(placement: "Placement", ctx: LoadContext) -> None:
    """The placement against the model's nodes (from its config: no weights yet), this
    machine's GPUs, and what runs today; raises PlacementError ("FILE:LINE: problem")."""
    from omniwalk.placement import check_model, check_runnable

    nodes = None if ctx.family.nodes is None else {node.name: node for node in ctx.family.nodes(ctx.config)}
    # counted only where the file names GPUs: a CPU placement never asks the CUDA driver
    num_gpus = torch.cuda.device_count() if any(group.gpus for group in placement.groups) else 0
    check_model(placement, ctx.family, ctx.config, nodes, num_gpus, workers_here=ctx.args.ray_address is None)
    check_runnable(placement, ctx.family)


def tensor_parallel_families() -> list[str]:
    """The registered families that split over several devices."""
    from omniwalk.models.registry import FAMILIES

    return sorted(name for name, family in FAMILIES.items() if family.tensor_parallel is not None)


def load_model(args: EngineArgs) -> LoadedModel:
    """A built-in name or a local Hugging Face folder, through the one loading pipeline."""
    ctx = read_model(args)
    family, folder, spec = ctx.family, ctx.folder, ctx.family.loader
    rename = None if spec.rename is None else (lambda name: spec.rename(ctx.config, name))
    ctx.module = build_module(lambda: spec.build(ctx.config), ctx.device, ctx.dtype, ctx.random_weights,
                              args.seed, folder, rename=rename)
    if spec.after_weights is not None:
        spec.after_weights(ctx)
    quantize_backbone(args, ctx.module)
    if spec.resources is not None:
        spec.resources(ctx)
    ctx.max_model_len = spec.max_model_len(ctx) if spec.max_model_len is not None else context_length(args, ctx.config)
    num_layers, num_kv_heads, head_dim = spec.kv_layout(ctx.config)
    shape = kv_cache_shape(args, num_layers, num_kv_heads, head_dim, ctx.device, ctx.dtype)
    ctx.cache = PagedKVCache(shape, ctx.dtype, ctx.device, enable_prefix_caching=_prefix_caching(ctx))
    step = spec.decode_step(ctx) if spec.decode_step is not None else ctx.module
    ctx.decode_graphs = capture_decode_graphs(args, step, ctx.cache, ctx.max_model_len, ctx.slot_resource)
    if spec.prefill_graphs:
        ctx.prefill_graphs = capture_prefill_graphs(step, ctx.decode_graphs, spec.conv_kernel(ctx.config)
                                                    if spec.conv_kernel is not None else None,
                                                    spec.prefill_graph_sequences or args.max_num_seqs + 1,
                                                    spec.prefill_graph_tokens or args.max_num_batched_tokens)
    if ctx.device.type == "cuda" and args.startup_warmup is not False:
        warm_up_moe_kernels(ctx.module, args.max_num_batched_tokens)
    served = spec.serve(ctx)
    if args.placement is not None and family.nodes is None:   # its nodes are known only now
        from omniwalk.placement import check_nodes

        check_nodes(args.placement, served.graph.nodes, family.name)
    tp = tensor_parallel_group()
    logger.info("loaded %s (%s, %s on %s%s%s); KV cache: %d tokens in %d pages of %d%s",
                args.model, family.name, ctx.dtype, ctx.device, ", random weights" if ctx.random_weights else "",
                f", tensor parallel rank {tp.rank} of {tp.size}, KV heads here: {num_kv_heads}" if tp.size > 1 else "",
                shape.capacity_tokens, shape.num_pages, shape.page_size,
                ", prefix caching" if ctx.cache.enable_prefix_caching else "")
    return loaded_model(ctx, ctx.max_model_len, shape.capacity_tokens, served)


def loaded_model(ctx: LoadContext, max_model_len: int, kv_capacity_tokens: int,
                 served: "ServedModel | None" = None) -> LoadedModel:
    """What `read_model` found, with the sizes only loading the model tells (and the model itself
    where it is here)."""
    return LoadedModel(ctx.args.model, ctx.config, ctx.tokenizer, ctx.device, ctx.dtype, max_model_len,
                       ctx.eos_token_ids, ctx.random_weights, ctx.family, kv_capacity_tokens, ctx.source, served)


def _prefix_caching(ctx: LoadContext) -> bool:
    reason = ctx.family.loader.no_prefix_caching
    if ctx.args.enable_prefix_caching and reason is not None:
        logger.info("prefix caching is off for %s: %s", ctx.family.name, reason)
    return ctx.args.enable_prefix_caching and reason is None


def read_model_source(ctx: LoadContext) -> None:
    """Config, tokenizer, EOS ids and weight source of a built-in tiny model (folder None)
    or a local checkpoint folder: the shared first step of loading."""
    from omniwalk.models.registry import TINY_TOKENIZER

    family, folder = ctx.family, ctx.folder
    if folder is None:   # built-in tiny model
        ctx.tokenizer = load_tokenizer(TINY_TOKENIZER)
        ctx.config = family.tiny_config(len(ctx.tokenizer))
        ctx.eos_token_ids = frozenset(ctx.config.eos_token_ids) | {ctx.tokenizer.convert_tokens_to_ids("<|im_end|>")}
        ctx.random_weights = True
        return
    ctx.config = family.config_from_hf(read_hf_config(folder))
    if has_tokenizer_files(folder):
        ctx.tokenizer = load_tokenizer(folder)
    else:
        logger.warning("no tokenizer files in %s: token ids only, no text", folder)
        ctx.tokenizer = NoTokenizer()
    ctx.eos_token_ids = generation_eos(folder, ctx.config.eos_token_ids)
    ctx.random_weights = ctx.args.load_format == "dummy"


def generation_eos(folder: Path, default: tuple[int, ...]) -> frozenset[int]:
    """EOS ids as HF `generate` uses them: generation_config.json first, then config.json."""
    path = folder / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset(default)


# Above this many parameters random weights are drawn on the GPU (seconds, not minutes of
# CPU sampling); their values then differ from a CPU draw of the same seed.
LARGE_RANDOM_MODEL = 4_000_000_000


def build_module(make, device: torch.device, dtype: torch.dtype, random_weights: bool, seed: int,
                 folder: Path | None, rename=None) -> torch.nn.Module:
    """`make()` built on `device` in `dtype`, filled with seeded random or checkpoint weights."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else default_dtype)
    try:   # built in the dtype: a 30B model never exists in fp32 on the GPU
        with torch.device(device):
            module = make().to(dtype)
    finally:
        torch.set_default_dtype(default_dtype)
    if random_weights:
        init_random_weights(module, seed, on_device=device.type == "cuda"
                            and sum(p.numel() for p in module.parameters()) > LARGE_RANDOM_MODEL)
    else:
        skipped = load_checkpoint_weights(module, folder, rename=rename)
        if skipped:
            parts = sorted({".".join(name.split(".")[:2]) for name in skipped})
            logger.info("%s: %d checkpoint tensors not loaded, not part of the served model (%s)", folder,
                        len(skipped), ", ".join(f"{part}.*" for part in parts))
    return module.eval()


def quantize_backbone(args: EngineArgs, lm: torch.nn.Module) -> None:
    """Applies `args.quantization` to a loaded decoder, before any CUDA graph captures it
    and before the KV cache is sized from the memory it frees."""
    if args.quantization is None:
        return
    from omniwalk.layers.fp8_linear import fp8_supported, fuse_input_quantization, quantize_linear_layers

    device = next(lm.parameters()).device
    if device.type == "cuda" and not fp8_supported(device):
        raise ValueError("--quantization fp8 needs a GPU with FP8 tensor cores (compute capability 8.9+)")
    if device.type == "cuda" and next(lm.parameters()).dtype != torch.bfloat16:
        raise ValueError("--quantization fp8 on a GPU needs --dtype bfloat16 (FP8 GEMMs write bf16)")
    swapped = quantize_linear_layers(lm)
    fused = fuse_input_quantization(lm)
    if device.type == "cuda":
        torch.cuda.empty_cache()   # the bf16 weights' memory goes back to the KV cache's budget
    logger.info("quantized %d linear layers to fp8 (weights per channel, activations per token; %d of them "
                "read rows their norm or SiLU-mul quantized)", swapped, fused)


def context_length(args: EngineArgs, config) -> int:
    return min(config.max_position_embeddings, args.max_model_len or config.max_position_embeddings)


def uses_decode_graphs(args: EngineArgs, device: torch.device) -> bool:
    # tensor parallel: no graphs yet (collectives inside a captured graph are untested)
    return device.type == "cuda" and not args.enforce_eager and args.tensor_parallel_size == 1


def capture_decode_graphs(args: EngineArgs, lm, cache: PagedKVCache, max_model_len: int,
                          slot_resource=None) -> DecodeGraphs | None:
    """CUDA graphs of the decode step (None on CPU or with --enforce-eager)."""
    if not uses_decode_graphs(args, cache.keys.device):
        return None
    graphs = DecodeGraphs(lm, cache, args.max_num_seqs, -(-max_model_len // args.page_size), slot_resource)
    started = time.perf_counter()
    graphs.capture()
    logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", graphs.buckets, time.perf_counter() - started)
    return graphs


def capture_prefill_graphs(lm, graphs: DecodeGraphs | None, conv_kernel: int | None = None,
                           max_sequences: int | None = None, max_tokens: int | None = None):
    """CUDA graphs of prefill batches (a request joining a running batch, a wave's prompts)
    of up to `max_tokens` tokens (a step's budget; None: 256) in up to `max_sequences`
    pieces, padding included (None: 8), beside the decode graphs; None without those or if
    capture fails."""
    if graphs is None:
        return None
    from omniwalk.engine.prefill_graphs import MAX_SEQUENCES, MAX_TOKENS, SEQUENCE_BUCKETS, TOKEN_BUCKETS, PrefillGraphs
    from omniwalk.layers.gated_delta_rule import RECURRENT_PREFILL_MAX_LEN

    # a hybrid model's pieces stay short enough for its recurrent layers' one-launch kernel
    if conv_kernel is not None:
        max_tokens = RECURRENT_PREFILL_MAX_LEN
    max_tokens = _bucket_at_least(TOKEN_BUCKETS, max_tokens or MAX_TOKENS)
    prefill = PrefillGraphs(lm, graphs, conv_kernel=conv_kernel, max_tokens=max_tokens,
                            max_sequences=_bucket_at_least(SEQUENCE_BUCKETS, max_sequences or MAX_SEQUENCES))
    started = time.perf_counter()
    try:
        prefill.capture()
        # the eager pass's kernels (no PDL) compiled now too: a step the graphs do not hold
        # (a full budget and its padding, media rows) would compile them mid-serving
        prefill.run_eagerly_once()
    except Exception:   # the eager pass does the same work, with more launches
        logger.exception("could not capture the prefill CUDA graphs; small prefill batches run eagerly")
        return None
    logger.info("captured prefill CUDA graphs for (tokens, sequences) %s in %.1f s", prefill.buckets,
                time.perf_counter() - started)
    return prefill


def _bucket_at_least(buckets: tuple[int, ...], wanted: int) -> int:
    """The smallest bucket that holds `wanted` (the largest if none does)."""
    return next((b for b in buckets if b >= wanted), buckets[-1])


def kv_cache_shape(args: EngineArgs, num_layers: int, num_kv_heads: int, head_dim: int, device: torch.device,
                   dtype: torch.dtype) -> KVCacheShape:
    """Pages for `num_layers` attention layers. On GPU sized from the memory still free:
    allocate other resources first."""
    per_page = KVCacheShape(num_layers, num_kv_heads, head_dim, args.page_size, 1)
    if args.kv_cache_tokens is not None:
        num_pages = -(-args.kv_cache_tokens // args.page_size)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - args.gpu_memory_utilization) * total
        num_pages = int(budget // per_page.bytes_per_page(dtype))
        if num_pages < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free); "
                               f"raise --gpu-memory-utilization or use a smaller model")
    else:
        num_pages = 65536 // args.page_size
    return KVCacheShape(num_layers, num_kv_heads, head_dim, args.page_size, num_pages)
