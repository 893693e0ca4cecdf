"""Loading Whisper.

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
from pathlib import Path
from types import SimpleNamespace


from omniwalk.engine.cross_attention import CrossAttentionCache, CrossAttentionShape
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.loading import (
    EngineArgs, LoadedModel, NoTokenizer, build_module, capture_decode_graphs, has_tokenizer_files, kv_cache_shape,
    load_tokenizer, resolve_device, resolve_dtype, uses_decode_graphs,
)
from omniwalk.models.loader import read_hf_config
from omniwalk.models.whisper.config import WhisperConfig, WhisperGenerationConfig, tiny_config
from omniwalk.models.whisper.executors import DecoderStep
from omniwalk.models.whisper.features import FeatureConfig, LogMelFeatures
from omniwalk.models.whisper.model import WhisperTranscriptionModel
from omniwalk.models.whisper.modeling import WhisperForConditionalGeneration

logger = logging.getLogger(__name__)

TINY_ASSETS = Path(__file__).parent / "assets" / "tiny-whisper"


def read_feature_config(folder: Path, num_mel_bins: int) -> FeatureConfig:
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return FeatureConfig(num_mel_bins=num_mel_bins)
    return FeatureConfig.from_preprocessor_config(json.loads(path.read_text()), num_mel_bins)


def load_whisper(args: EngineArgs, family, folder: Path | None) -> LoadedModel:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    source = TINY_ASSETS if folder is None else folder
    if folder is None:
        tokenizer = load_tokenizer(TINY_ASSETS)
        config = tiny_config(len(tokenizer))
        random_weights = True
    else:
        config = WhisperConfig.from_hf(read_hf_config(folder))
        tokenizer = load_tokenizer(folder) if has_tokenizer_files(folder) else NoTokenizer()
        random_weights = args.load_format == "dummy"
    generation = WhisperGenerationConfig.from_folder(source)
    feature_config = read_feature_config(source, config.num_mel_bins)
    if feature_config.num_frames != config.num_frames:
        raise ValueError(f"windows of {feature_config.num_frames} mel frames; the encoder takes {config.num_frames}")

    tied = config.tie_word_embeddings
    net = build_module(lambda: WhisperForConditionalGeneration(config), device, dtype, random_weights, args.seed,
                       folder, rename=lambda name: None if tied and name == "proj_out.weight" else name)

    num_slots = args.max_num_seqs + (1 if uses_decode_graphs(args, device) else 0)
    cross = CrossAttentionCache(CrossAttentionShape(
        config.decoder_layers, num_slots, config.max_source_positions, config.decoder_attention_heads,
        config.decoder_head_dim), dtype, device)
    layout = SimpleNamespace(num_layers=config.decoder_layers, num_kv_heads=config.decoder_attention_heads,
                             head_dim=config.decoder_head_dim)
    shape = kv_cache_shape(args, layout, device, dtype)
    if shape.capacity_tokens < config.max_target_positions:
        raise ValueError(f"the KV cache holds {shape.capacity_tokens} tokens; one Whisper window needs "
                         f"{config.max_target_positions}")
    cache = PagedKVCache(shape, dtype, device, enable_prefix_caching=False)
    graphs = capture_decode_graphs(args, DecoderStep(net), cache, config.max_target_positions, slot_resource=cross)
    served = WhisperTranscriptionModel(net, cache, cross, generation, LogMelFeatures(feature_config),
                                       max_batch_size=args.max_num_seqs, decode_graphs=graphs)
    logger.info("loaded %s (whisper, %s on %s%s); %d cross-attention slots, KV cache: %d tokens",
                args.model, dtype, device, ", random weights" if random_weights else "",
                args.max_num_seqs, shape.capacity_tokens)
    return LoadedModel(args.model, served, config, tokenizer, device, dtype, config.max_target_positions,
                       generation.eos_token_ids, random_weights)
