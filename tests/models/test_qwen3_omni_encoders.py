"""Qwen3-Omni's media encoders and preprocessing against transformers: the audio tower on a
batch of clips (each compared with the reference run on that clip alone), the vision tower
on images of different grids (embeds and every deepstack feature), image patches and log-mel
features bit for bit, placeholder token counts as the HF processor expands them, and
decode_image's refusals."""

from __future__ import annotations

import dataclasses
import io
import struct
import zlib

import numpy as np
import pytest
import torch

from omniwalk.models.qwen3_omni.audio_encoder import AudioEncoder, audio_output_length
from omniwalk.models.qwen3_omni.encoder_config import AudioEncoderConfig, VisionEncoderConfig
from omniwalk.models.qwen3_omni.media import (
    AudioProcessor, ImageProcessor, ImageSettings, audio_token_count, decode_image, image_token_count,
)
from omniwalk.models.qwen3_omni.vision_encoder import VisionEncoder

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_modeling  # noqa: E402

SR = 16000
ATOL = 1e-5


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (LayerNorms and biases too), so every parameter matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


# ---------------------------------------------------------------- audio tower


@pytest.fixture(scope="module")
def audio_pair():
    config = AudioEncoderConfig.tiny(output_dim=24)
    hf_config = transformers.Qwen3OmniMoeAudioEncoderConfig(**dataclasses.asdict(config))
    hf_config._attn_implementation = "eager"
    assert AudioEncoderConfig.from_hf(hf_config.to_dict()) == config
    torch.manual_seed(0)
    reference = perturbed(hf_modeling.Qwen3OmniMoeAudioEncoder(hf_config), seed=1)
    ours = AudioEncoder(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)      # same names, nothing missing
    return ours, reference


def test_audio_encoder_batch_matches_reference_per_clip(audio_pair):
    ours, reference = audio_pair
    config = ours.config
    # 7.3 s: 7 full chunks + a tail, 4 attention windows of 2 chunks; 0.6 s: shorter than a
    # chunk; 3 s: whole chunks only
    frames = [730, 60, 300]
    assert frames[1] < config.chunk_frames
    assert audio_output_length(frames[0], config.n_window) > 2 * 13 * config.chunks_per_window
    gen = torch.Generator().manual_seed(2)
    features = [torch.randn(config.num_mel_bins, n, generator=gen) for n in frames]
    with torch.no_grad():
        outputs = ours(features)
        assert [o.shape for o in outputs] == [(audio_output_length(n), 24) for n in frames]
        for f, out in zip(features, outputs):
            expected = reference(f, torch.tensor([f.shape[1]])).last_hidden_state
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
        # the same clip alone gives the same tokens: no dependence on the rest of the batch
        alone = ours(features[1:2])[0]
    torch.testing.assert_close(alone, outputs[1], atol=ATOL, rtol=0)


def test_audio_windows_do_not_cross_clips(audio_pair):
    ours, _ = audio_pair
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(128, 250, generator=gen) for _ in range(2))
    with torch.no_grad():
        first = ours([a, b])[0]
        changed = ours([a, b * 3 + 1])[0]
    torch.testing.assert_close(first, changed, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- vision tower


def test_vision_encoder_matches_reference_per_image():
    config = VisionEncoderConfig.tiny(out_hidden_size=48)
    hf_kwargs = dataclasses.asdict(config)
    hf_kwargs["rope_parameters"] = {"rope_type": "axial", "rope_theta": hf_kwargs.pop("rope_theta")}
    hf_config = transformers.Qwen3OmniMoeVisionEncoderConfig(**hf_kwargs)
    hf_config._attn_implementation = "eager"
    assert VisionEncoderConfig.from_hf(hf_config.to_dict()) == config
    torch.manual_seed(0)
    reference = perturbed(hf_modeling.Qwen3OmniMoeVisionEncoder(hf_config), seed=4)
    ours = VisionEncoder(config).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)

    grids = [(1, 6, 8), (1, 4, 10), (2, 4, 4)]          # two images and a 2-frame clip
    gen = torch.Generator().manual_seed(5)
    patches = [torch.randn(t * h * w, config.patch_dim, generator=gen) for t, h, w in grids]
    tokens = [t * h * w // 4 for t, h, w in grids]
    with torch.no_grad():
        embeds, deepstack = ours(torch.cat(patches), grids)
        assert embeds.shape == (sum(tokens), 48) and len(deepstack) == 2
        for i, (p, grid) in enumerate(zip(patches, grids)):
            expected = reference(p, torch.tensor([grid]))
            torch.testing.assert_close(embeds.split(tokens)[i], expected.pooler_output, atol=ATOL, rtol=0)
            for ours_feature, hf_feature in zip(deepstack, expected.deepstack_features, strict=True):
                torch.testing.assert_close(ours_feature.split(tokens)[i], hf_feature, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- preprocessing


def hf_processor(settings: ImageSettings):
    """The expansion code of `Qwen3OmniMoeProcessor` over the image processor and feature
    extractor its preprocessor_config.json names, without a tokenizer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = transformers.Qwen3OmniMoeProcessor.__new__(transformers.Qwen3OmniMoeProcessor)
    processor.image_processor = Qwen2VLImageProcessorPil(
        patch_size=settings.patch_size, temporal_patch_size=settings.temporal_patch_size,
        merge_size=settings.merge_size, min_pixels=settings.min_pixels, max_pixels=settings.max_pixels,
        image_mean=list(settings.image_mean), image_std=list(settings.image_std))
    processor.feature_extractor = transformers.WhisperFeatureExtractor(
        feature_size=128, sampling_rate=SR, hop_length=160, n_fft=400, chunk_length=300,
        return_attention_mask=True)
    processor.image_token, processor.audio_token = "<I>", "<A>"
    return processor


@pytest.mark.parametrize("max_pixels", [12845056, 128 * 128])   # the checkpoint's; one that shrinks
def test_image_patches_match_hf(max_pixels):
    settings = ImageSettings(max_pixels=max_pixels)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (300, 500, 3), dtype=np.uint8)   # 300 x 500 -> 288 x 512 unshrunk
    pixels[100:200] //= 3                                          # some structure for the resampler
    processed, replacements = hf_processor(settings)._process_images([pixels], return_tensors="np")

    patches, grid = ImageProcessor(settings)(pixels)
    assert grid == tuple(processed["image_grid_thw"][0])
    assert grid == ImageProcessor(settings).grid(300, 500)
    np.testing.assert_array_equal(patches.numpy(), processed["pixel_values"])
    assert image_token_count(grid, settings.merge_size) == replacements[0].count("<I>")


def test_audio_features_and_token_count_match_hf():
    t = np.arange(int(3.3 * SR) + 37) / SR
    audio = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * np.random.default_rng(1).standard_normal(t.size))
    audio = audio.astype(np.float32)
    processed, replacements = hf_processor(ImageSettings())._process_audio(
        [audio], n_window=50, return_tensors="np", **transformers.Qwen3OmniMoeProcessor.audio_kwargs)

    features = AudioProcessor()(audio)
    frames = int(processed["feature_attention_mask"].sum())
    assert features.shape == (128, frames) == (128, AudioProcessor().num_frames(audio.size))
    np.testing.assert_allclose(features.numpy(), processed["input_features"][0, :, :frames], atol=1e-6, rtol=0)
    assert audio_token_count(frames) == replacements[0].count("<A>") == 43


# ---------------------------------------------------------------- decode_image


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a scrap of pixel data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_decode_image_rejects_garbage():
    with pytest.raises(ValueError, match="could not be decoded"):
        decode_image(b"definitely not an image")
    with pytest.raises(ValueError, match="uint8"):
        decode_image(np.zeros((4, 4, 3), dtype=np.float32))


def test_decode_image_checks_the_size_before_decoding(monkeypatch):
    from PIL import ImageFile

    def no_decoding(self):
        raise AssertionError("decoded before the size check")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ValueError, match="too large: 10000x10000"):
        decode_image(png_header_only(10_000, 10_000))             # 100 MP, above PIL's own warning level
    with pytest.raises(ValueError, match="too large"):
        decode_image(png_header_only(100_000, 100_000))           # PIL's own bomb error, as a ValueError


def test_decode_image_returns_rgb():
    from PIL import Image

    rgba = np.zeros((3, 5, 4), dtype=np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255                                 # one opaque red pixel, the rest transparent
    buffer = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buffer, format="PNG")
    pixels = decode_image(buffer.getvalue())
    assert pixels.shape == (3, 5, 3) and pixels.dtype == np.uint8
    assert tuple(pixels[0, 0]) == (200, 0, 0) and tuple(pixels[1, 1]) == (255, 255, 255)
