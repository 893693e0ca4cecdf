"""Loading Orpheus: the Llama backbone plus a SNAC codec.

    tiny-orpheus          a tiny Llama over TINY_TOKENS + TINY_SNAC, random weights from
                          EngineArgs.seed (the SNAC from seed + 1); no codec folder
    <folder>              a local Orpheus checkpoint (Llama config.json whose vocabulary
                          holds the audio-code ids, *.safetensors, tokenizer files), and a
                          local SNAC folder (config.json + pytorch_model.bin or *.safetensors):
                          EngineArgs.codec, or else `<folder>/snac`
    --load-format dummy   random weights at the checkpoint's shapes; the SNAC at its
                          folder's config if there is one, else at snac_24khz's
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.layers.transformer import CausalLM
from omniwalk.loading import (
    EngineArgs, LoadedModel, build_module, capture_decode_graphs, capture_prefill_graphs, context_length, kv_cache_shape,
    quantize_backbone, read_model_source, resolve_device, resolve_dtype, uses_decode_graphs,
)
from omniwalk.models.orpheus.config import ORPHEUS_3B, TINY_SNAC, TINY_TOKENS, samples_per_frame
from omniwalk.models.orpheus.model import CENTRE, HEAD, TAIL, WINDOW_FRAMES, OrpheusModel
from omniwalk.models.orpheus.snac import (
    SNAC_24KHZ, SnacDecoder, init_random_snac, load_snac_state, read_snac_config, read_snac_state,
)
from omniwalk.models.orpheus.snac_graphs import SnacGraphs

logger = logging.getLogger(__name__)

# Full windows per SNAC graph replay: a step with more decodes them in parts. Bounds the
# graphs' activation memory (~1 GB for whole windows at snac_24khz; the three cropped sets
# take ~1.6x that), taken before the KV cache is sized.
MAX_GRAPH_WINDOWS = 64


def codec_folder(args: EngineArgs, folder: Path) -> Path:
    """Where the SNAC of a checkpoint folder is: EngineArgs.codec, else `<folder>/snac`."""
    return Path(args.codec) if args.codec else folder / "snac"


def load_orpheus(args: EngineArgs, family, folder: Path | None) -> LoadedModel:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if folder is None and args.codec:
        raise ValueError(f"{args.model} has its codec built in; `codec` is for checkpoint folders")
    tokens = TINY_TOKENS if folder is None else ORPHEUS_3B
    snac_folder = None if folder is None else codec_folder(args, folder)
    if snac_folder is not None and not (snac_folder / "config.json").is_file() and args.load_format != "dummy":
        raise FileNotFoundError(f"Orpheus needs a local SNAC folder (config.json + weights, as "
                                f"hubertsiuzdak/snac_24khz ships): none at {snac_folder}; pass "
                                f"EngineArgs(codec=...) or place it at {folder / 'snac'}")
    config, tokenizer, _, random_weights = read_model_source(args, family, folder)
    if config.vocab_size < tokens.audio_end:
        raise ValueError(f"vocabulary of {config.vocab_size} ids lacks Orpheus' audio codes (up to {tokens.audio_end})")

    lm = build_module(lambda: CausalLM(config), device, dtype, random_weights, args.seed, folder)
    lm.logit_ids = tokens.sampled_ids   # before the decode graphs capture the LM head
    quantize_backbone(args, lm)
    snac = _load_snac(snac_folder, random_weights, args.seed + 1).to(device).eval()
    if snac.config.codebook_size != tokens.codebook_size:
        raise ValueError(f"SNAC codebook of {snac.config.codebook_size} entries; the checkpoint's "
                         f"audio ids need {tokens.codebook_size}")

    snac_graphs = None
    if uses_decode_graphs(args, device):   # before the KV cache, which takes what memory is left
        windows, frame = min(args.max_num_seqs, MAX_GRAPH_WINDOWS), samples_per_frame(snac.config)
        # one set per frame range a full window emits: a request's first window, the centre
        # (every other window), the final flush; each decodes only its samples
        snac_graphs = {emit: SnacGraphs(snac, WINDOW_FRAMES, windows, keep=(emit[0] * frame, emit[1] * frame))
                       for emit in (HEAD, CENTRE, TAIL)}
        started = time.perf_counter()
        for graphs in snac_graphs.values():
            graphs.capture()
        logger.info("captured SNAC CUDA graphs (first, centre and last windows) for %s windows in %.1f s",
                    snac_graphs[CENTRE].buckets, time.perf_counter() - started)
    max_model_len = context_length(args, config)
    shape = kv_cache_shape(args, config, device, dtype)
    cache = PagedKVCache(shape, dtype, device)
    graphs = capture_decode_graphs(args, lm, cache, max_model_len)
    served = OrpheusModel(lm, cache, snac, tokens, max_batch_size=args.max_num_seqs, decode_graphs=graphs,
                          snac_graphs=snac_graphs, prefill_graphs=capture_prefill_graphs(lm, graphs))
    logger.info("loaded %s (orpheus, %s on %s%s; SNAC %s); KV cache: %d tokens",
                args.model, dtype, device, ", random weights" if random_weights else "",
                snac_folder or "built-in", shape.capacity_tokens)
    return LoadedModel(args.model, served, config, tokenizer, device, dtype, max_model_len,
                       frozenset({tokens.end_of_speech}), random_weights)


def _load_snac(folder: Path | None, random_weights: bool, seed: int) -> SnacDecoder:
    """fp32 always: the codec is small and its parity is checked in fp32."""
    if folder is None:
        config = TINY_SNAC
    elif (folder / "config.json").is_file():
        config = read_snac_config(folder)
    else:   # dummy weights without a SNAC folder
        config = SNAC_24KHZ
    snac = SnacDecoder(config)
    if random_weights:
        init_random_snac(snac, seed)
    else:
        load_snac_state(snac, read_snac_state(folder))
    return snac
