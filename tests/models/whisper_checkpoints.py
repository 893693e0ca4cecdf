"""Tiny random Whisper checkpoints written by transformers, the test clips, and HF's
features, for the Whisper tests (imported by name: the tests' directory is on sys.path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

ASSETS = Path(__file__).parents[2] / "omniwalk" / "models" / "whisper" / "assets" / "tiny-whisper"
SR = 16000
WINDOW = 30 * SR


def clip(kind: str, seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(SR * seconds)) / SR
    if kind == "sine":
        x = 0.5 * np.sin(2 * np.pi * (220 + 40 * seed) * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    elif kind == "chirp":
        x = 0.4 * np.sin(2 * np.pi * (200 + 400 * t / seconds + 30 * seed) * t)
    else:
        x = 0.1 * np.random.default_rng(seed).standard_normal(t.size)
    return x.astype(np.float32)


def hf_generation_config(folder: Path = ASSETS) -> transformers.GenerationConfig:
    return transformers.GenerationConfig.from_pretrained(folder)


def save_tiny_whisper(folder: Path, max_target_positions: int, *, num_mel_bins: int = 80, encoder_layers: int = 2,
                      decoder_layers: int = 2, eos_like: tuple[int, float] | None = None, **config):
    """A tiny random WhisperForConditionalGeneration with tiny-whisper's tokenizer and
    generation config, saved to `folder`; weights x10 so greedy ids depend on the audio.
    `eos_like` (token, scale): EOS's embedding row (tied: its logit) becomes that token's
    scaled, so EOS is sampled where the token would be. Returns the model."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(ASSETS)
    generation = hf_generation_config()
    hf_config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=num_mel_bins, d_model=64, encoder_layers=encoder_layers,
        encoder_attention_heads=4, decoder_layers=decoder_layers, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=max_target_positions,
        decoder_start_token_id=generation.decoder_start_token_id, pad_token_id=generation.pad_token_id,
        bos_token_id=generation.bos_token_id, eos_token_id=generation.eos_token_id, **config,
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(hf_config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(10.0)
        if eos_like is not None:
            token, scale = eos_like
            rows = model.get_output_embeddings().weight
            rows[generation.eos_token_id] = scale * rows[token]
    model.generation_config = generation
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=num_mel_bins).save_pretrained(folder)
    return model


def features(audio: np.ndarray, num_mel_bins: int = 80) -> torch.Tensor:
    """[1, mels, frames] as HF's generate takes them: up to 30 s padded to one window
    (short-form), longer ones whole (long-form: truncation=False, padding="longest")."""
    extractor = transformers.WhisperFeatureExtractor(feature_size=num_mel_bins)
    long_form = dict(truncation=False, padding="longest") if audio.size > WINDOW else {}
    return extractor(audio, sampling_rate=SR, return_tensors="pt", **long_form).input_features


def window_of(frames: torch.Tensor, seek: int) -> torch.Tensor:
    """[1, mels, 3000]: the window at `seek`, zero-padded, as HF's long-form loop cuts it."""
    part = frames[:, :, seek:seek + 3000]
    return torch.nn.functional.pad(part, (0, 3000 - part.shape[-1]))
