"""What loading Whisper does differently from the shared pipeline (omniwalk.loading).

    tiny-whisper          tiny widths (config.tiny_config), random weights from EngineArgs.seed;
                          tokenizer, generation and preprocessor configs in assets/tiny-whisper
    <folder>              a local checkpoint as transformers writes it: config.json
                          (model_type whisper), *.safetensors, tokenizer files,
                          generation_config.json, preprocessor_config.json (optional: the
                          default extractor at the config's mel bins)
    --load-format dummy   random weights at the checkpoint's shapes

Resources, in this order (the KV cache takes what GPU memory is left): one
cross-attention slot per running request (`max_num_seqs`, + one for the decode graphs'
padded rows on CUDA), then the paged
self-attention KV cache of the decoder (no prefix caching: a decoder's keys depend
on its audio through cross-attention, so equal prompts do not mean equal keys).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from omniwalk.engine.cross_attention import CrossAttentionCache, CrossAttentionShape
from omniwalk.loading import build_module, uses_decode_graphs
from omniwalk.models.family import LoaderSpec
from omniwalk.models.loader import read_hf_config
from omniwalk.models.whisper.config import WhisperConfig, WhisperGenerationConfig, tiny_config
from omniwalk.models.whisper.encoder_graphs import EncoderGraphs
from omniwalk.models.whisper.executors import DecoderStep, EncoderExecutor
from omniwalk.models.whisper.features import FeatureConfig, LogMelFeatures
from omniwalk.models.whisper.model import ENCODER, WhisperTranscriptionModel
from omniwalk.models.whisper.modeling import WhisperForConditionalGeneration
from omniwalk.tokenizer import NoTokenizer, has_tokenizer_files, load_tokenizer

logger = logging.getLogger(__name__)

TINY_ASSETS = Path(__file__).parent / "assets" / "tiny-whisper"
MAX_ENCODER_WINDOWS = 16   # windows one encoder pass takes (a graph per bucket up to it on CUDA)


def read_feature_config(folder: Path, num_mel_bins: int) -> FeatureConfig:
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return FeatureConfig(num_mel_bins=num_mel_bins)
    return FeatureConfig.from_preprocessor_config(json.loads(path.read_text()), num_mel_bins)


def read_whisper_source(ctx) -> None:
    """Config, tokenizer, generation config (forced prompt, suppression, EOS) and the
    log-mel feature extractor of the tiny built-in or a checkpoint folder."""
    folder = ctx.folder
    source = TINY_ASSETS if folder is None else folder
    if folder is None:
        ctx.tokenizer = load_tokenizer(TINY_ASSETS)
        ctx.config = tiny_config(len(ctx.tokenizer))
        ctx.random_weights = True
    else:
        ctx.config = WhisperConfig.from_hf(read_hf_config(folder))
        ctx.tokenizer = load_tokenizer(folder) if has_tokenizer_files(folder) else NoTokenizer()
        ctx.random_weights = ctx.args.load_format == "dummy"
    generation = WhisperGenerationConfig.from_folder(source)
    feature_config = read_feature_config(source, ctx.config.num_mel_bins)
    if feature_config.num_frames != ctx.config.num_frames:
        raise ValueError(f"windows of {feature_config.num_frames} mel frames; the encoder takes "
                         f"{ctx.config.num_frames}")
    ctx.eos_token_ids = generation.eos_token_ids
    ctx.source.update(generation=generation, features=LogMelFeatures(feature_config))


def allocate_resources(ctx) -> None:
    """One cross-attention slot per running request (+ one for the decode graphs' padded
    rows), and on CUDA the encoder's graphs (their memory pool before the KV cache takes
    what is left)."""
    config = ctx.config
    graphs = uses_decode_graphs(ctx.args, ctx.device)
    num_slots = ctx.args.max_num_seqs + (1 if graphs else 0)
    ctx.slot_resource = CrossAttentionCache(CrossAttentionShape(
        config.decoder_layers, num_slots, config.max_source_positions, config.decoder_attention_heads,
        config.decoder_head_dim), ctx.dtype, ctx.device)
    ctx.resources["encoder_graphs"] = capture_encoder_graphs(ctx.module.encoder) if graphs else None


def capture_encoder_graphs(encoder) -> EncoderGraphs:
    graphs = EncoderGraphs(encoder, MAX_ENCODER_WINDOWS)
    started = time.perf_counter()
    graphs.capture()
    logger.info("captured encoder CUDA graphs for %s windows in %.1f s", graphs.buckets, time.perf_counter() - started)
    return graphs


def encoder_executor(ctx) -> EncoderExecutor:
    """Node `encoder` alone, in a worker process of its own (a placement's other group): the
    whole model built there (random weights are drawn over all of it, so the encoder's equal
    the engine's), its decoder dropped."""
    net = build_module(lambda: WhisperForConditionalGeneration(ctx.config), ctx.device, ctx.dtype, ctx.random_weights,
                       ctx.args.seed, ctx.folder, rename=lambda name: WHISPER_LOADER.rename(ctx.config, name))
    net.fuse_projections()
    encoder = net.encoder
    del net
    graphs = capture_encoder_graphs(encoder) if uses_decode_graphs(ctx.args, ctx.device) else None
    return EncoderExecutor(encoder, MAX_ENCODER_WINDOWS, ctx.args.max_num_seqs, graphs)


def serve_whisper(ctx) -> WhisperTranscriptionModel:
    config = ctx.config
    if ctx.cache.shape.capacity_tokens < config.max_target_positions:
        raise ValueError(f"the KV cache holds {ctx.cache.shape.capacity_tokens} tokens; one Whisper window needs "
                         f"{config.max_target_positions}")
    return WhisperTranscriptionModel(ctx.module, ctx.cache, ctx.slot_resource, ctx.source["generation"],
                                     ctx.source["features"], max_batch_size=ctx.args.max_num_seqs,
                                     max_encoder_windows=MAX_ENCODER_WINDOWS, decode_graphs=ctx.decode_graphs,
                                     prefill_graphs=ctx.prefill_graphs, encoder_graphs=ctx.resources["encoder_graphs"])


WHISPER_LOADER = LoaderSpec(
    build=WhisperForConditionalGeneration,
    read_source=read_whisper_source,
    rename=lambda config, name: None if config.tie_word_embeddings and name == "proj_out.weight" else name,
    after_weights=lambda ctx: ctx.module.fuse_projections(),
    resources=allocate_resources,
    max_model_len=lambda ctx: ctx.config.max_target_positions,
    kv_layout=lambda config: (config.decoder_layers, config.decoder_attention_heads, config.decoder_head_dim),
    no_prefix_caching="a decoder's keys depend on its audio through cross-attention",
    decode_step=lambda ctx: DecoderStep(ctx.module),
    # a window's forced prompt (4 tokens, ~650 launches eagerly: 25-33 ms of host a window at
    # c = 1 in the step probe at cb0225a) and a wave's mixed batches replay graphs; an encoder
    # pass starts up to MAX_ENCODER_WINDOWS prompts in one step (eagerly at c = 32: 43 ms of host)
    prefill_graphs=True,
    prefill_graph_sequences=2 * MAX_ENCODER_WINDOWS,
    prefill_graph_tokens=256,   # forced prompts of 4 tokens (a `prompt` of up to 224 runs eagerly)
    serve=serve_whisper,
    worker_executors={ENCODER.name: encoder_executor},
)
