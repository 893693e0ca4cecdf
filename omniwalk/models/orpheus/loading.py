"""What loading Orpheus does differently from the shared pipeline (omniwalk.loading): the
Llama backbone scores audio codes alone, and a SNAC codec (with its CUDA graphs) is
loaded before the KV cache.

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

from omniwalk.loading import read_model_source, uses_decode_graphs
from omniwalk.models.decoder_lm.modeling import CausalLM
from omniwalk.models.family import LoaderSpec
from omniwalk.models.orpheus.config import ORPHEUS_3B, TINY_SNAC, TINY_TOKENS, samples_per_frame
from omniwalk.models.orpheus.model import (
    CENTRE, HEAD, SNAC_DECODER, TAIL, WINDOW_FRAMES, OrpheusModel, SnacDecoderExecutor,
)
from omniwalk.models.orpheus.snac import (
    SNAC_24KHZ, SnacConfig, SnacDecoder, init_random_snac, load_snac_state, read_snac_config, read_snac_state,
)
from omniwalk.models.orpheus.snac_graphs import SnacGraphs

logger = logging.getLogger(__name__)

# Full windows per SNAC graph replay: a step with more decodes them in parts. Bounds the
# graphs' activation memory (~1 GB for whole windows at snac_24khz; the three cropped sets
# take ~1.6x that), taken before the KV cache is sized.
MAX_GRAPH_WINDOWS = 64


def codec_folder(args, folder: Path) -> Path:
    """Where the SNAC of a checkpoint folder is: EngineArgs.codec, else `<folder>/snac`."""
    return Path(args.codec) if args.codec else folder / "snac"


def read_orpheus_source(ctx) -> None:
    """The shared source (config, tokenizer, weights), the checkpoint's token layout, and
    where its SNAC is and its config; end_of_speech is the one EOS."""
    args, folder = ctx.args, ctx.folder
    if folder is None and args.codec:
        raise ValueError(f"{args.model} has its codec built in; `codec` is for checkpoint folders")
    tokens = TINY_TOKENS if folder is None else ORPHEUS_3B
    snac_folder = None if folder is None else codec_folder(args, folder)
    if snac_folder is not None and not (snac_folder / "config.json").is_file() and args.load_format != "dummy":
        raise FileNotFoundError(f"Orpheus needs a local SNAC folder (config.json + weights, as "
                                f"hubertsiuzdak/snac_24khz ships): none at {snac_folder}; pass "
                                f"EngineArgs(codec=...) or place it at {folder / 'snac'}")
    read_model_source(ctx)
    if ctx.config.vocab_size < tokens.audio_end:
        raise ValueError(f"vocabulary of {ctx.config.vocab_size} ids lacks Orpheus' audio codes "
                         f"(up to {tokens.audio_end})")
    ctx.eos_token_ids = frozenset({tokens.end_of_speech})
    ctx.source.update(tokens=tokens, snac_config=_snac_config(snac_folder))
    ctx.resources.update(snac_folder=snac_folder)


def score_sampled_ids_only(ctx) -> None:
    """Before the decode graphs capture the LM head: it scores the sampled ids alone."""
    ctx.module.logit_ids = ctx.source["tokens"].sampled_ids


def load_codec(ctx) -> None:
    """The SNAC decoder, and on CUDA its graphs, before the KV cache takes what memory is left;
    none where a placement runs it in a worker process (`snac_executor` loads it there)."""
    if ctx.args.placement is not None and SNAC_DECODER.name in ctx.args.placement.worker_nodes:
        ctx.resources.update(snac=None, snac_graphs=None)
        return
    tokens, snac_folder = ctx.source["tokens"], ctx.resources["snac_folder"]
    snac = _load_snac(ctx.source["snac_config"], snac_folder, ctx.random_weights, ctx.args.seed + 1)
    snac = snac.to(ctx.device).eval()
    if snac.config.codebook_size != tokens.codebook_size:
        raise ValueError(f"SNAC codebook of {snac.config.codebook_size} entries; the checkpoint's "
                         f"audio ids need {tokens.codebook_size}")
    snac_graphs = None
    if uses_decode_graphs(ctx.args, ctx.device):
        windows, frame = min(ctx.args.max_num_seqs, MAX_GRAPH_WINDOWS), samples_per_frame(snac.config)
        # one set per frame range a full window emits: a request's first window, the centre
        # (every other window), the final flush; each decodes only its samples
        snac_graphs = {emit: SnacGraphs(snac, WINDOW_FRAMES, windows, keep=(emit[0] * frame, emit[1] * frame))
                       for emit in (HEAD, CENTRE, TAIL)}
        started = time.perf_counter()
        for graphs in snac_graphs.values():
            graphs.capture()
        logger.info("captured SNAC CUDA graphs (first, centre and last windows) for %s windows in %.1f s",
                    snac_graphs[CENTRE].buckets, time.perf_counter() - started)
    logger.info("SNAC codec: %s", snac_folder or "built-in, random weights")
    ctx.resources.update(snac=snac, snac_graphs=snac_graphs)


def snac_executor(ctx) -> SnacDecoderExecutor:
    """Node `snac_decoder` alone, in a worker process of its own (a placement's other group):
    the codec from `read_model`'s context, the backbone not loaded there."""
    load_codec(ctx)
    return SnacDecoderExecutor(ctx.resources["snac"], ctx.args.max_num_seqs, ctx.resources["snac_graphs"])


def serve_orpheus(ctx) -> OrpheusModel:
    return OrpheusModel(ctx.module, ctx.cache, ctx.resources["snac"], ctx.source["tokens"],
                        max_batch_size=ctx.args.max_num_seqs, decode_graphs=ctx.decode_graphs,
                        snac_graphs=ctx.resources["snac_graphs"], prefill_graphs=ctx.prefill_graphs,
                        codec=ctx.source["snac_config"])


ORPHEUS_LOADER = LoaderSpec(build=CausalLM, read_source=read_orpheus_source, after_weights=score_sampled_ids_only,
                            resources=load_codec, serve=serve_orpheus,
                            worker_executors={SNAC_DECODER.name: snac_executor})


def _snac_config(folder: Path | None) -> SnacConfig:
    if folder is None:
        return TINY_SNAC
    if (folder / "config.json").is_file():
        return read_snac_config(folder)
    return SNAC_24KHZ   # dummy weights without a SNAC folder


def _load_snac(config: SnacConfig, folder: Path | None, random_weights: bool, seed: int) -> SnacDecoder:
    """fp32 always: the codec is small and its parity is checked in fp32."""
    snac = SnacDecoder(config)
    if random_weights:
        init_random_snac(snac, seed)
    else:
        load_snac_state(snac, read_snac_state(folder))
    return snac
