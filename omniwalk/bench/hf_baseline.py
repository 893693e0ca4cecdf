"""`--baseline hf`: the same prompts through Hugging Face `generate`, offline, in fixed batches.

For each batch size c (the run's concurrency), the measured requests are cut into
ceil(n / c) batches of exactly c prompts (the last one filled by cycling from the start,
so every timed batch has one shape), at most `max_batches` of them: HF at batch 1 runs
at tens of tokens/s, and a few batches give its steady rate. Every prompt is left-padded (masked) to the longest
prompt of the workload and every batch generates exactly L = the longest output length,
greedy, `min_new_tokens = max_new_tokens = L` (HF's way to ignore EOS). Two modes:

    eager            the default dynamic cache, no compilation
    static_compiled  `cache_implementation="static"`: generate compiles the decode forward
                     itself (transformers' compiled path; a `CompileConfig`, fullgraph, static
                     shapes, mode reduce-overhead on CUDA as transformers defaults); the
                     prefill stays eager

Each mode runs `warmup_batches` untimed batches first (compilation happens there). Figures:
tokens generated (rows x L, checked against the returned tensor) per second of `generate`.
With ranged lengths the tokens generated exceed the tokens the workload asked for; both are
reported.

The model is `AutoModelForCausalLM`'s or, for a config that it does not map (Qwen3-Omni's
thinker), the class named in the config's `architectures`. Prompts are token ids only: the
bench refuses this baseline for an audio-in workload.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from omniwalk.bench.workload import BenchRequest
from omniwalk.loading import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

MODES = ("eager", "static_compiled")


@dataclass(frozen=True)
class HFBaselineConfig:
    model: str                        # a local Hugging Face folder
    load_format: str = "auto"         # auto: its weights; dummy: random weights from its config.json
    dtype: str = "auto"               # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    compile_backend: str = "inductor"
    compile_mode: str | None = None   # None: reduce-overhead on CUDA, default elsewhere
    warmup_batches: int = 1
    max_batches: int | None = 3      # timed batches per batch size; None: all the requests
    modes: tuple[str, ...] = MODES

    def __post_init__(self):
        if not Path(self.model).is_dir():
            raise ValueError(f"--baseline hf runs transformers on a local Hugging Face folder; {self.model!r} is "
                             f"not one (a built-in tiny-* model has none): give --model FOLDER, or --hf-model "
                             f"FOLDER for the baseline alone (any checkpoint folder, or a model saved with "
                             f"save_pretrained)")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown HF baseline mode(s) {sorted(unknown)}; known: {MODES}")


def load_hf_model(config: HFBaselineConfig):
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    hf_config = AutoConfig.from_pretrained(config.model)
    model_class = hf_model_class(hf_config)
    if config.load_format == "dummy":
        torch.manual_seed(0)
        with torch.device(device):
            if model_class is AutoModelForCausalLM:
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
            else:
                model = model_class._from_config(hf_config, dtype=dtype)
    else:
        model = model_class.from_pretrained(config.model, dtype=dtype).to(device)
    return model.eval()


def hf_model_class(hf_config):
    """AutoModelForCausalLM when it maps the config, else the class its `architectures` names:
    Qwen3-Omni's thinker (`qwen3_omni_moe_thinker`) is mapped under image-text-to-text only,
    and its `generate` takes text-only input ids as a causal LM's does."""
    import transformers

    if type(hf_config) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM
    for name in getattr(hf_config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    raise ValueError(f"--baseline hf: transformers maps no causal LM to model type {hf_config.model_type!r}, "
                     f"and the config's architectures ({hf_config.architectures}) name no transformers class")


def make_batches(requests: list[BenchRequest], batch_size: int,
                 max_batches: int | None = None) -> list[list[BenchRequest]]:
    """ceil(n / c) batches (at most max_batches) of exactly c, the last filled by cycling from the start."""
    if not requests:
        return []
    count = math.ceil(len(requests) / batch_size)
    if max_batches is not None:
        count = min(count, max_batches)
    return [[requests[i % len(requests)] for i in range(b * batch_size, (b + 1) * batch_size)]
            for b in range(count)]


def left_padded(batch: list[BenchRequest], width: int, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # input_ids / attention_mask: [batch, width], prompts right-aligned
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, width - request.prompt_len:] = torch.tensor(request.prompt_token_ids)
        mask[row, width - request.prompt_len:] = 1
    return input_ids.to(device), mask.to(device)


class HFBaseline:
    """One loaded HF model; `run(requests, batch_size)` measures every configured mode."""

    def __init__(self, config: HFBaselineConfig):
        self.config = config
        self.model = load_hf_model(config)
        self.device = self.model.device
        generation = self.model.generation_config
        eos = generation.eos_token_id
        self.pad_id = generation.pad_token_id if generation.pad_token_id is not None else (
            (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0)

    def run(self, requests: list[BenchRequest], batch_size: int) -> dict:
        batches = make_batches(requests, batch_size, self.config.max_batches)
        results = {"batch_size": batch_size, "num_batches": len(batches), "device": str(self.device),
                   "dtype": str(self.model.dtype).replace("torch.", ""), "modes": {}}
        for mode in self.config.modes:
            results["modes"][mode] = self._measure(mode, batches, requests)
        return results

    def _measure(self, mode: str, batches: list[list[BenchRequest]], requests: list[BenchRequest]) -> dict:
        width = max(r.prompt_len for r in requests)
        new_tokens = max(r.output_len for r in requests)
        options = self._generate_options(mode, new_tokens)
        if mode == "static_compiled":
            torch._dynamo.reset()   # each batch size compiles afresh, in its own warmup
        graphs_before = _compiled_graphs()
        started = time.perf_counter()
        for batch in batches[: self.config.warmup_batches]:
            self._generate(batch, width, options)
        warmup_s = time.perf_counter() - started
        graphs_warm = _compiled_graphs()
        generated, started = 0, time.perf_counter()
        for batch in batches:
            generated += self._generate(batch, width, options)
        seconds = time.perf_counter() - started
        requested = sum(r.output_len for batch in batches for r in batch)
        result = {
            "tokens_generated": generated, "tokens_expected": len(batches) * len(batches[0]) * new_tokens,
            "requested_output_tokens": requested, "new_tokens_per_row": new_tokens, "prompt_width": width,
            "seconds": seconds, "output_tokens_per_s": generated / seconds if seconds > 0 else 0.0,
            "requested_tokens_per_s": requested / seconds if seconds > 0 else 0.0, "warmup_s": warmup_s,
        }
        if mode == "static_compiled":
            # generate compiles only when its own criteria hold: say whether it did, and whether
            # anything compiled inside the timed batches (it should not)
            result["compiled_graphs"] = graphs_warm - graphs_before
            result["graphs_compiled_while_timed"] = _compiled_graphs() - graphs_warm
            result["compile_backend"] = options["compile_config"].backend
            result["compile_mode"] = options["compile_config"].mode
        return result

    def _generate_options(self, mode: str, new_tokens: int) -> dict:
        options = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=self.pad_id, top_p=None, top_k=None, temperature=None)
        if mode == "static_compiled":
            from transformers import CompileConfig

            on_cuda = self.device.type == "cuda"
            mode_name = self.config.compile_mode or ("reduce-overhead" if on_cuda else "default")
            # dynamic=False: one static graph per batch size, HF's best case
            compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=self.config.compile_backend,
                                           mode=mode_name)
            if not on_cuda:   # transformers compiles on CUDA only unless told
                compile_config._compile_all_devices = True
            options.update(cache_implementation="static", compile_config=compile_config)
        return options

    @torch.inference_mode()
    def _generate(self, batch: list[BenchRequest], width: int, options: dict) -> int:
        input_ids, mask = left_padded(batch, width, self.pad_id, self.device)
        output = self.model.generate(input_ids=input_ids, attention_mask=mask, **options)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # output: [batch, width + new tokens]
        return int(output[:, width:].numel())

    def close(self) -> None:
        """Free the model (and compiled graphs) before an in-process engine sizes its KV cache."""
        self.model = None
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_hf_baseline(config: HFBaselineConfig, requests: list[BenchRequest], batch_sizes: list[int]) -> dict[int, dict]:
    """Every batch size with one loaded model; the model is freed afterwards."""
    baseline = HFBaseline(config)
    try:
        return {c: baseline.run(requests, c) for c in batch_sizes}
    finally:
        baseline.close()
