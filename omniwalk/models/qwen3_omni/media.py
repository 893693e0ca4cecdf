"""Qwen3-Omni's media preprocessing, CPU only, for the API process: image bytes -> RGB
pixels -> patches + grid; 16 kHz audio -> log-mel features; and the number of placeholder
tokens (`<|image_pad|>`, `<|audio_pad|>`) each item takes in the prompt.

The references are what the checkpoint's `preprocessor_config.json` names:

- images: `Qwen2VLImageProcessor`, the PIL/NumPy processor of transformers 4.x the model
  was released with (in transformers 5 `Qwen2VLImageProcessorPil`; the class that kept the
  name resizes with torchvision and rounds differently). Qwen3-Omni's settings: patch 16,
  temporal patch 2, merge 2, 3136 <= pixels <= 12845056, mean = std = 0.5.
- audio: `WhisperFeatureExtractor` with 128 mel bins, as `Qwen3OmniMoeProcessor` calls it
  (padding to the longest clip, no truncation): one clip gives [128, samples // 160].

An image becomes:

    [H, W, 3] uint8 -> resize (PIL bicubic) to (h, w), multiples of patch * merge = 32 with
    h * w in [min_pixels, max_pixels], the aspect ratio kept -> x / 255 -> (x - mean) / std
    -> the frame repeated temporal_patch_size times -> patches in 2x2 merge blocks:
    [(h / 16) * (w / 16), 3 * 2 * 16 * 16], grid (1, h / 16, w / 16)
"""

from __future__ import annotations

import functools
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from omniwalk.models.qwen3_omni.audio_encoder import audio_output_length
from omniwalk.models.whisper.features import mel_filters

# Decoding a bigger image is refused from its header alone (a 64 MP RGB image is 192 MiB);
# the processor shrinks anything above max_pixels (12.8 MP) anyway.
MAX_DECODED_PIXELS = 64 * 1024 * 1024
MAX_ASPECT_RATIO = 200


# ---------------------------------------------------------------- decoding


def decode_image(data: bytes | np.ndarray, max_pixels: int = MAX_DECODED_PIXELS) -> np.ndarray:
    """Encoded image bytes (any format PIL reads; the first frame of an animation) or an
    [H, W, 3] uint8 array -> [H, W, 3] uint8 RGB. EXIF orientation is applied and
    transparency composited onto white, as transformers' image loading does.
    ValueError, with a message for the client, for data that is not an image or one of more
    than `max_pixels` pixels (checked from the header, before decoding)."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 3 or data.shape[2] != 3 or 0 in data.shape:
            raise ValueError(f"an image array must be [height, width, 3] uint8, got {list(data.shape)} {data.dtype}")
        _check_pixels(data.shape[1], data.shape[0], max_pixels)
        return np.ascontiguousarray(data)
    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)   # the cap below decides
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"the image is too large: {e}") from None
    except Exception as e:                          # PIL raises many kinds for data it cannot read
        raise ValueError("the image data could not be decoded (not a supported image format)") from e
    _check_pixels(*image.size, max_pixels)
    try:
        image.load()
        image = _to_rgb(ImageOps.exif_transpose(image))
    except Exception as e:
        raise ValueError("the image data could not be decoded (corrupt or truncated)") from e
    return np.asarray(image, dtype=np.uint8)


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"the image is empty ({width}x{height})")
    if width * height > max_pixels:
        raise ValueError(f"the image is too large: {width}x{height} pixels, at most {max_pixels} are accepted")


def _to_rgb(image):
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


# ---------------------------------------------------------------- images


@dataclass(frozen=True)
class ImageSettings:
    """The image half of a Qwen3-Omni `preprocessor_config.json` (defaults: the checkpoint's)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self):
        object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0.0 in self.image_std:
            raise ValueError("image_mean and image_std need 3 values, std nonzero")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one output token's side in pixels)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(cls, d: dict) -> "ImageSettings":
        """`size.{shortest,longest}_edge` as transformers reads it, overridden by
        `min_pixels` / `max_pixels`, as `Qwen2VLImageProcessor.__init__` does."""
        kwargs = {k: d[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
                  if d.get(k) is not None}
        size = d.get("size") or {}
        min_pixels = d.get("min_pixels", size.get("shortest_edge"))
        max_pixels = d.get("max_pixels", size.get("longest_edge"))
        if min_pixels is not None:
            kwargs["min_pixels"] = min_pixels
        if max_pixels is not None:
            kwargs["max_pixels"] = max_pixels
        return cls(**kwargs)


class ImageProcessor:
    """[H, W, 3] uint8 RGB -> (patches float32 [N, 3 * T * P * P], grid (t, h, w) in patches)."""

    def __init__(self, settings: ImageSettings = ImageSettings()):
        self.settings = settings

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' `smart_resize`: sides rounded to multiples of `factor`, then scaled
        (keeping the aspect ratio) into [min_pixels, max_pixels]."""
        s, factor = self.settings, self.settings.factor
        if height <= 0 or width <= 0:
            raise ValueError(f"the image is empty ({width}x{height})")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"the image's aspect ratio must be at most {MAX_ASPECT_RATIO}:1, got {width}x{height}")
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > s.max_pixels:
            beta = math.sqrt(height * width / s.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < s.min_pixels:
            beta = math.sqrt(s.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of an image of this size, without processing it."""
        h, w = self.resized_size(height, width)
        return 1, h // self.settings.patch_size, w // self.settings.patch_size

    def __call__(self, pixels: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        from PIL import Image

        s = self.settings
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"expected [height, width, 3] uint8 pixels, got {list(pixels.shape)} {pixels.dtype}")
        h, w = self.resized_size(*pixels.shape[:2])
        resized = np.asarray(Image.fromarray(pixels).resize((w, h), resample=Image.Resampling.BICUBIC))
        return torch.from_numpy(self._patchify(resized)), (1, h // s.patch_size, w // s.patch_size)

    def _patchify(self, resized: np.ndarray) -> np.ndarray:
        # resized: [h, w, C] uint8 -> [gh * gw, C * T * P * P] float32, patches in merge-block order
        s = self.settings
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        h, w, c = resized.shape
        n = (h // p) * (w // p)
        blocks = resized.reshape(h // (p * m), m, p, w // (p * m), m, p, c)    # [bh, mh, ph, bw, mw, pw, C]
        blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 4, 6, 2, 5))   # [bh, bw, mh, mw, C, ph, pw]
        # normalize by table lookup, row c * 256 + value: uint8 has 256 values per channel
        offsets = (np.arange(c, dtype=np.intp) * 256)[None, :, None, None]
        values = np.take(self._table, blocks.reshape(n, c, 1, p * p) + offsets)  # [n, C, 1, P * P]
        return np.broadcast_to(values, (n, c, t, p * p)).reshape(n, c * t * p * p)  # the frame T times

    @functools.cached_property
    def _table(self) -> np.ndarray:
        """[C * 256] float32: channel c's value v normalized, as transformers computes it:
        v * (1 / 255) in fp64, cast to fp32, then (x - mean) / std in fp32."""
        s = self.settings
        levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
        mean = np.array(s.image_mean, dtype=np.float32)[:, None]
        std = np.array(s.image_std, dtype=np.float32)[:, None]
        return ((levels[None, :] - mean) / std).reshape(-1)


def image_token_count(grid_thw: tuple[int, int, int], merge_size: int = 2) -> int:
    """`<|image_pad|>` tokens of an image: one per merge_size x merge_size patches."""
    t, h, w = grid_thw
    return t * h * w // merge_size ** 2


# ---------------------------------------------------------------- audio


@dataclass(frozen=True)
class AudioSettings:
    """The audio half of a Qwen3-Omni `preprocessor_config.json` (WhisperFeatureExtractor's
    arguments; defaults: the checkpoint's)."""

    num_mel_bins: int = 128      # "feature_size"
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400

    def __post_init__(self):
        for name in ("num_mel_bins", "sampling_rate", "hop_length", "n_fft"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_preprocessor_config(cls, d: dict) -> "AudioSettings":
        if d.get("dither", 0.0):
            raise ValueError("dithered features (dither != 0) are not supported")
        return cls(num_mel_bins=d.get("feature_size", 128), sampling_rate=d.get("sampling_rate", 16000),
                   hop_length=d.get("hop_length", 160), n_fft=d.get("n_fft", 400))


class AudioProcessor:
    """Mono float32 samples at `sampling_rate` -> log-mel features [num_mel_bins, frames],
    frames = samples // hop_length, as WhisperFeatureExtractor computes one unpadded clip:
    |STFT|^2 (Hann, centred, last frame dropped) -> Slaney mel filters -> log10(max(., 1e-10))
    -> max(., clip max - 8) -> (. + 4) / 4. The clamp is to the whole clip's maximum."""

    def __init__(self, settings: AudioSettings = AudioSettings()):
        self.settings = settings
        filters = mel_filters(settings.num_mel_bins, settings.n_fft, settings.sampling_rate)
        self.filters = torch.from_numpy(filters).float()              # [bins, mels]
        self.window = torch.hann_window(settings.n_fft)

    def num_frames(self, num_samples: int) -> int:
        return num_samples // self.settings.hop_length

    @torch.inference_mode()
    def __call__(self, samples: np.ndarray | torch.Tensor) -> torch.Tensor:
        s = self.settings
        audio = torch.as_tensor(samples, dtype=torch.float32).cpu()
        if audio.dim() != 1:
            raise ValueError(f"audio must be mono samples [num_samples], got shape {list(audio.shape)}")
        if audio.numel() <= s.n_fft // 2:
            raise ValueError(f"the audio is too short: {audio.numel()} samples, at least {s.n_fft // 2 + 1} "
                             f"({(s.n_fft // 2 + 1) / s.sampling_rate * 1000:.1f} ms) are needed")
        if not bool(torch.isfinite(audio).all()):
            raise ValueError("the audio has non-finite samples")
        stft = torch.stft(audio[None], s.n_fft, s.hop_length, window=self.window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()                # [1, bins, frames]
        log_spec = torch.clamp(self.filters.T @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0)[0]


def audio_token_count(frames: int, n_window: int = 50) -> int:
    """`<|audio_pad|>` tokens of a clip of `frames` mel frames (the audio tower's output length)."""
    return int(audio_output_length(frames, n_window))
