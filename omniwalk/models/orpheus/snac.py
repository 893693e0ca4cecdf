"""SNAC's decoding path: codes of three (or more) levels -> latent -> 24 kHz waveform.

Written from the architecture of the `snac` package (Siuzdak, "SNAC: Multi-Scale Neural
Audio Codec"); only what decoding needs. Module and parameter names follow the `snac`
checkpoints (`quantizer.quantizers.0.codebook.weight`, `decoder.model.2.block.1.weight`),
so a local folder as `hubertsiuzdak/snac_24khz` ships (config.json + pytorch_model.bin or
*.safetensors) loads by name. The checkpoint stores its convolutions weight-normalized
(`parametrizations.weight.original0/1`, or `weight_g/weight_v` in older files); they
are folded into plain weights at load, since decoding never trains.

    codes[l]: [B, T / s_l]   (s = vq_strides, e.g. 4, 2, 1)
      -> embed (codebook) -> 1x1 out_proj -> repeat each step s_l times, sum over levels
    latent:   [B, latent_dim, T]
      -> depthwise 7-tap conv + 1x1 conv to decoder_dim
      -> per rate r: Snake, transposed conv (x r), noise injection, 3 dilated residual units
      -> Snake, 7-tap conv to 1 channel, tanh
    audio:    [B, 1, T * prod(decoder_rates)]

Noise. SNAC's decoder adds `randn * conv1x1(x)` after every upsampling (the `noise`
option, on in snac_24khz), drawn from torch's global generator even at inference. Here
the noise is an argument: `torch_global_noise` draws exactly what the `snac` package
draws (for parity tests), `SeededNoise` makes it a pure function of (per-row key, block,
time step) so decoding is reproducible and independent of batch composition, and None
leaves it out.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from omniwalk.engine.sampler import hash_uniform, row_keys
from omniwalk.kernels import snac as snac_ops

# (upsampling block index, activations [B, C, T], the true time step of x[..., 0], the
# block's full output length) -> noise [B, 1, T]: the noise of those T steps of the block
NoiseSource = Callable[[int, torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class SnacConfig:
    """The `config.json` of a SNAC checkpoint (the encoder fields are kept, not used)."""

    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = None          # None: encoder_dim * 2 ** len(encoder_rates)
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    attn_window_size: int | None = None
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    def __post_init__(self):
        for name in ("encoder_rates", "decoder_rates", "vq_strides"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.attn_window_size is not None:
            raise ValueError("SNAC with local attention (attn_window_size) is not supported: only the "
                             "attention-free decoders (snac_24khz, as Orpheus uses) are")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve {len(self.decoder_rates)} times")
        if any(self.vq_strides[0] % s for s in self.vq_strides):
            raise ValueError(f"vq_strides {self.vq_strides} must divide the first one")

    @property
    def latent_channels(self) -> int:
        return self.latent_dim or self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        """Output samples per latent step (the finest code level)."""
        return math.prod(self.decoder_rates)

    @classmethod
    def from_dict(cls, values: dict) -> "SnacConfig":
        known = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


SNAC_24KHZ = SnacConfig()
"""hubertsiuzdak/snac_24khz, the codec of Orpheus: 3 levels at 12, 23, 47 Hz; 19.8 M parameters."""


# ---------------------------------------------------------------------------------- layers


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        return snac_ops.snake(x, self.alpha)   # one Triton kernel on CUDA (`omniwalk.kernels.snac`)


class DepthwiseConv1d(nn.Conv1d):
    """`nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2,
    groups=channels)`: same parameters and names, so checkpoints load as for `nn.Conv1d`;
    one Triton kernel on CUDA (`omniwalk.kernels.snac.depthwise_conv1d`)."""

    def __init__(self, channels: int, kernel_size: int, dilation: int = 1):
        if (kernel_size - 1) * dilation % 2:
            raise ValueError("a length-preserving depthwise conv needs an even (kernel_size - 1) * dilation")
        super().__init__(channels, channels, kernel_size, dilation=dilation,
                         padding=dilation * (kernel_size - 1) // 2, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [B, C, T] -> [B, C, T]
        if not snac_ops.use_triton(x):
            return super().forward(x)
        return snac_ops.depthwise_conv1d(x, self.weight, self.bias, self.dilation[0], self.padding[0])


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(conv7_dilated(snake(x)))); the padding keeps the length."""

    def __init__(self, dim: int, dilation: int, groups: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim),
            (DepthwiseConv1d(dim, 7, dilation) if groups == dim
             else nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation, groups=groups)),
            Snake(dim),
            nn.Conv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first_snake, conv, second_snake, last = self.block
        if not (snac_ops.use_triton(x) and isinstance(conv, DepthwiseConv1d)):
            return x + self.block(x)
        # three kernels: Snake; the dilated conv with the second Snake; the 1x1 conv with the add
        y = snac_ops.depthwise_conv1d(first_snake(x), conv.weight, conv.bias, conv.dilation[0], conv.padding[0],
                                      snake_alpha=second_snake.alpha)
        return snac_ops.pointwise_conv(y, last.weight, last.bias, residual=x)


class NoiseInjection(nn.Module):
    """x + noise * conv1x1(x), one noise value per (row, time step) shared by all channels."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Conv1d(dim, dim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:  # noise: [B, 1, T]
        return snac_ops.pointwise_conv(x, self.linear.weight, None, residual=x, scale=noise)


# Transposed convolutions over at most this many input steps run as a GEMM + overlap-add
# on CUDA (`UpsampleBlock._upsample_as_gemm`); longer ones through cuDNN.
SHORT_UPSAMPLE_INPUT = 32


class UpsampleBlock(nn.Module):
    """Snake, transposed conv by `rate`, optional noise, residual units at dilations 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int, noise: bool, groups: int):
        super().__init__()
        layers: list[nn.Module] = [
            Snake(in_dim),
            # length * rate exactly: (L-1)r - 2 ceil(r/2) + 2r + r%2 = L r
            nn.ConvTranspose1d(in_dim, out_dim, kernel_size=2 * rate, stride=rate,
                               padding=math.ceil(rate / 2), output_padding=rate % 2),
        ]
        if noise:
            layers.append(NoiseInjection(out_dim))
        layers += [ResidualUnit(out_dim, dilation, groups) for dilation in (1, 3, 9)]
        self.block = nn.ModuleList(layers)
        self._gemm_weight: tuple | None = None   # ((data_ptr, version), the weight as a 1x1 conv's)

    @property
    def residual_reach(self) -> int:
        """Steps on each side an output of the residual units reads (3 taps x dilation each)."""
        return sum(layer.block[1].dilation[0] * 3 for layer in self.block if isinstance(layer, ResidualUnit))

    def forward(self, x: torch.Tensor, noise: NoiseSource | None, index: int, start: int = 0,
                total: int | None = None) -> torch.Tensor:
        """x: [B, in, T] -> [B, out, T * rate]. x may be a crop of the block's input: its
        output then begins at output step `start` of `total` (the noise is positional)."""
        for layer in self.block:
            if isinstance(layer, NoiseInjection):
                if noise is not None:
                    x = layer(x, noise(index, x, start, x.shape[-1] if total is None else total))
            elif (isinstance(layer, nn.ConvTranspose1d) and x.shape[-1] <= SHORT_UPSAMPLE_INPUT
                  and snac_ops.use_triton(x)):
                x = self._upsample_as_gemm(layer, x)
            else:
                x = layer(x)
        return x

    def _upsample_as_gemm(self, conv: nn.ConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
        """conv(x) for a short x as one product and an overlap-add. With kernel 2 * rate, output
        step t (t + padding = q * rate + r) sums tap r at input step q and tap r + rate at q - 1:

            y[o, k, (b, q)] = sum_i W[i, o, k] x[b, i, q]                 (the 1x1-conv kernel)
            out[b, o, q * rate + r - padding] = y[o, r, (b, q)] + y[o, r + rate, (b, q - 1)] + bias[o]

        cuDNN's algorithm for SNAC's first upsampling (1024 -> 512 channels, 16 steps a
        window) took ~1 ms per 64 windows on the H200, this ~0.17 ms; for the longer inputs
        of the later blocks cuDNN is faster (a probe at 78d31df: benchmarks/scripts/snac_upsample.py)."""
        batch, channels_in, length = x.shape
        rate, padding = conv.stride[0], conv.padding[0]
        key = (conv.weight.data_ptr(), conv.weight._version)
        if self._gemm_weight is None or self._gemm_weight[0] != key:   # [out * taps, in, 1], once
            self._gemm_weight = (key, conv.weight.detach().permute(1, 2, 0).reshape(-1, channels_in, 1).contiguous())
        columns = x.transpose(0, 1).reshape(1, channels_in, batch * length)          # steps of all rows
        y = snac_ops.pointwise_conv(columns, self._gemm_weight[1], None, None)       # [1, out * 2 rate, B * L]
        channels_out = conv.out_channels
        y = y.view(channels_out, 2, rate, batch, length).permute(1, 3, 0, 4, 2)     # [half, B, out, L, r]
        now = torch.nn.functional.pad(y[0].reshape(batch, channels_out, length * rate), (0, rate))
        before = torch.nn.functional.pad(y[1].reshape(batch, channels_out, length * rate), (rate, 0))
        out = (now + before)[:, :, padding: padding + length * rate]
        return out + conv.bias[:, None] if conv.bias is not None else out.contiguous()


class WaveDecoder(nn.Module):
    """Latent [B, latent, T] -> audio [B, 1, T * hop_length] in [-1, 1]."""

    def __init__(self, config: SnacConfig):
        super().__init__()
        latent, channels = config.latent_channels, config.decoder_dim
        if config.depthwise:
            layers: list[nn.Module] = [
                DepthwiseConv1d(latent, 7),
                nn.Conv1d(latent, channels, kernel_size=1),
            ]
        else:
            layers = [nn.Conv1d(latent, channels, kernel_size=7, padding=3)]
        for i, rate in enumerate(config.decoder_rates):
            in_dim, out_dim = channels // 2 ** i, channels // 2 ** (i + 1)
            layers.append(UpsampleBlock(in_dim, out_dim, rate, config.noise,
                                        groups=out_dim if config.depthwise else 1))
        out_dim = channels // 2 ** len(config.decoder_rates)
        layers += [Snake(out_dim), nn.Conv1d(out_dim, 1, kernel_size=7, padding=3), nn.Tanh()]
        self.model = nn.ModuleList(layers)

    def forward(self, z: torch.Tensor, noise: NoiseSource | None,
                keep: tuple[int, int] | None = None) -> torch.Tensor:
        """keep = (a, b): only output samples [a, b), from the least input that determines
        them (`crop_plan`): the same values, ~half the work for a window's centre."""
        plan = None if keep is None else self.crop_plan(z.shape[-1], keep)
        x, block, start, length = z, 0, 0, z.shape[-1]   # x holds steps [start, start + T) of `length`
        for layer in self.model:
            if isinstance(layer, UpsampleBlock):
                rate = layer.block[1].stride[0]
                if plan is not None:
                    low, high = plan[block]
                    x, start = x[:, :, low - start : high - start].contiguous(), low
                x = layer(x, noise, block, start * rate, length * rate)
                block, start, length = block + 1, start * rate, length * rate
            else:
                x = layer(x)
        return x if keep is None else x[:, :, keep[0] - start : keep[1] - start]

    def crop_plan(self, latent_steps: int, keep: tuple[int, int]) -> list[tuple[int, int]]:
        """For each upsampling block, the input steps [low, high) that determine output
        samples [a, b) exactly. Computed backwards: the output conv reads 3 steps each side,
        a block's residual units `residual_reach`, and its transposed conv (kernel 2r,
        stride r, padding p) writes output t = q r + k - p from input q, k in [0, 2r).
        Outputs near a cropped edge are wrong (zero padding where the input went on); the
        plan keeps them out of [a, b)."""
        blocks = [layer for layer in self.model if isinstance(layer, UpsampleBlock)]
        rates = [block.block[1].stride[0] for block in blocks]
        inputs = [latent_steps * math.prod(rates[:i]) for i in range(len(rates))]
        low, high = keep[0] - 3, keep[1] + 3   # the final 7-tap conv
        plan: list[tuple[int, int]] = []
        for block, rate, steps in zip(reversed(blocks), reversed(rates), reversed(inputs)):
            reach, padding = block.residual_reach, block.block[1].padding[0]
            low, high = max(0, low - reach), min(steps * rate, high + reach)
            low = max(0, -(-(low + padding - 2 * rate + 1) // rate))
            high = min(steps, (high - 1 + padding) // rate + 1)
            plan.append((low, high))
        return plan[::-1]


class CodebookLevel(nn.Module):
    """One residual VQ level: codes -> codebook vectors -> 1x1 projection to the latent."""

    def __init__(self, config: SnacConfig, stride: int):
        super().__init__()
        self.stride = stride
        self.codebook = nn.Embedding(config.codebook_size, config.codebook_dim)
        self.out_proj = nn.Conv1d(config.codebook_dim, config.latent_channels, kernel_size=1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, T / stride] -> [B, latent, T]
        z = self.out_proj(self.codebook(codes).transpose(1, 2))
        # repeat_interleave(stride) as expand + reshape: no output-size sync (CUDA graphs)
        batch, channels, steps = z.shape
        return z.unsqueeze(-1).expand(batch, channels, steps, self.stride).reshape(batch, channels, steps * self.stride)


class CodeEmbedding(nn.Module):
    """Sum of the levels' projections: the quantized latent the encoder would have produced."""

    def __init__(self, config: SnacConfig):
        super().__init__()
        self.quantizers = nn.ModuleList(CodebookLevel(config, stride) for stride in config.vq_strides)

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        z = 0.0
        for level, level_codes in zip(self.quantizers, codes):
            z = z + level(level_codes)
        return z


class SnacDecoder(nn.Module):
    """codes (one [B, T / s_l] int tensor per level) -> audio [B, 1, T * hop_length], fp32."""

    def __init__(self, config: SnacConfig):
        super().__init__()
        self.config = config
        self.quantizer = CodeEmbedding(config)
        self.decoder = WaveDecoder(config)

    def forward(self, codes: list[torch.Tensor], noise: NoiseSource | None = None,
                keep: tuple[int, int] | None = None) -> torch.Tensor:
        """keep = (a, b): audio [B, 1, b - a], samples [a, b) of the whole decode (see WaveDecoder)."""
        if len(codes) != len(self.config.vq_strides):
            raise ValueError(f"{len(codes)} code levels for a SNAC with {len(self.config.vq_strides)}")
        return self.decoder(self.quantizer(codes), noise, keep)


# ---------------------------------------------------------------------------------- noise


def torch_global_noise(index: int, x: torch.Tensor, start: int = 0, total: int | None = None) -> torch.Tensor:
    """The draws of the `snac` package: torch.randn((B, 1, T)) per block, in block order."""
    steps = x.shape[2]
    drawn = torch.randn((x.shape[0], 1, total or steps), device=x.device, dtype=x.dtype)
    return drawn[:, :, start : start + steps]


class SeededNoise:
    """Standard normal noise that depends only on (row key, block index, time step).

    Box-Muller over two counter-based uniforms per step (the sampler's hash), so a row's
    noise is the same on CPU and GPU and whatever rows share its batch.
    """

    def __init__(self, keys):
        self.keys = keys   # one 64-bit key per batch row (ints or uint64)

    def __call__(self, index: int, x: torch.Tensor, start: int = 0, total: int | None = None) -> torch.Tensor:
        rows, _, steps = x.shape
        if rows != len(self.keys):
            raise ValueError(f"{len(self.keys)} noise keys for a batch of {rows}")
        total = total or steps
        u = hash_uniform(row_keys(self.keys, index), 2 * total, x.device)  # float64 (0, 1)
        return gaussian(u, start, steps, total).to(x.dtype).unsqueeze(1)


def gaussian(u: torch.Tensor, start: int, steps: int, total: int) -> torch.Tensor:
    """Box-Muller: normal draws at time steps [start, start + steps) from the [rows, 2 total]
    uniforms of a block (step t uses uniforms t and total + t)."""
    first, second = u[:, start : start + steps], u[:, total + start : total + start + steps]
    return torch.sqrt(-2.0 * torch.log(first)) * torch.cos(2.0 * math.pi * second)


# ---------------------------------------------------------------------------------- weights

_WEIGHT_NORM_PAIRS = (   # (magnitude g, direction v) suffixes of a weight-normalized tensor
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)


def _decoding_only(name: str) -> bool:
    return not (name.startswith("encoder.") or ".in_proj." in name)


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `snac` state dict with its weight norms folded into plain `.weight` tensors,
    restricted to the decoding path (the encoder and the quantizers' in_proj are dropped)."""
    folded: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not _decoding_only(name):
            continue
        pair = next((p for p in _WEIGHT_NORM_PAIRS if name.endswith(p[0]) or name.endswith(p[1])), None)
        if pair is None:
            folded[name] = tensor
        elif name.endswith(pair[0]):
            prefix = name[: -len(pair[0])]
            direction = state.get(prefix + pair[1])
            if direction is None:
                raise ValueError(f"SNAC checkpoint has {name} without {prefix + pair[1]}")
            # w = g * v / ||v||, the norm over every dim but 0 (torch's weight_norm, dim=0)
            folded[prefix + ".weight"] = torch._weight_norm(direction.float(), tensor.float(), 0)
    return folded


@torch.no_grad()
def load_snac_state(decoder: SnacDecoder, state: dict[str, torch.Tensor]) -> None:
    """Fill `decoder` from a `snac` state dict (weight-normalized or plain)."""
    folded = fold_weight_norm(state)
    params = dict(decoder.named_parameters())
    missing = sorted(set(params) - set(folded))
    unexpected = sorted(set(folded) - set(params))
    if missing or unexpected:
        raise ValueError(f"SNAC checkpoint does not match the decoder: missing {missing}, unexpected {unexpected}")
    for name, tensor in folded.items():
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.copy_(tensor.to(param.dtype))


def read_snac_state(folder: str | Path) -> dict[str, torch.Tensor]:
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file))
        return state
    path = folder / "pytorch_model.bin"
    if not path.is_file():
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in SNAC folder {folder}")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_snac_config(folder: str | Path) -> SnacConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in SNAC folder {folder}")
    return SnacConfig.from_dict(json.loads(path.read_text()))


def load_snac_decoder(folder: str | Path, device: torch.device | str = "cpu") -> SnacDecoder:
    """The decoder of a local SNAC folder, fp32, in eval mode."""
    decoder = SnacDecoder(read_snac_config(folder))
    load_snac_state(decoder, read_snac_state(folder))
    return decoder.to(device).eval()


@torch.no_grad()
def init_random_snac(decoder: SnacDecoder, seed: int) -> None:
    """Deterministic random weights that give audible, unsaturated output, from a private
    CPU generator: convolutions N(0, 1/fan_in), codebooks N(0, 1), Snake alphas 1, biases
    0; the last convolution 200x smaller, since the residual stack grows the activations
    to ~100 and tanh would clip everything to +-1."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    output_conv = f"decoder.model.{len(decoder.decoder.model) - 2}.weight"
    for name, param in decoder.named_parameters():
        if name.endswith(".alpha"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            fan_in = math.prod(param.shape[1:]) if param.dim() > 1 else 1
            if name.endswith("codebook.weight"):
                fan_in = 1
            std = fan_in ** -0.5 / (200.0 if name == output_conv else 1.0)
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            param.copy_(values)
