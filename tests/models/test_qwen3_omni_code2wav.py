"""Qwen3-Omni's Code2Wav against transformers' `Qwen3OmniMoeCode2Wav` on a tiny random
config: weights loaded by name from a `save_pretrained` folder, the whole decode equal to
the reference's, chunked decodes equal to the whole one at every seam for several chunk
schedules, a step's mixed chunks decoded in one batch (and by the executor) equal to each
decoded alone and to the whole decode, the transformer computing only the rows a chunk
needs, the sample counts, the receptive field the exact left context is built from
(checked on the module itself), transformers' `chunked_decode` losing the lookahead at each
seam, and config parsing from a full qwen3_omni_moe config."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from omniwalk.graph.chunking import StreamBuffer
from omniwalk.graph.primitives import LeftContext
from omniwalk.models.qwen3_omni.code2wav import (
    Code2Wav, CodecChunk, chunk_samples, conv_context_frames, emitted_samples, exact_left_context, lookahead_samples,
    transformer_context_frames,
)
from omniwalk.models.qwen3_omni.code2wav_config import Code2WavConfig
from omniwalk.models.qwen3_omni.speech_executors import Code2WavExecutor
from omniwalk.runtime.executor import NodeCall

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_modeling  # noqa: E402
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeCode2WavConfig, Qwen3OmniMoeConfig,
)

ATOL = 1e-5
CONFIG = Code2WavConfig.tiny()
U = CONFIG.samples_per_frame


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: on a shared CPU two threads spin against each other and run ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_config_dict(config: Code2WavConfig) -> dict:
    d = dataclasses.asdict(config)
    for key in ("rope_theta", "sample_rate", "head_dim"):
        d.pop(key)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    return d


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere, scaled so the waveform is neither tiny nor clamped: the
    default init leaves the SnakeBeta logs at 0, layer scales at 0.01 and ConvNeXt gammas at
    1e-6, which would hide most of the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name == "code_embedding.weight":
                param.copy_(noise)
            elif param.dim() >= 2:    # matrices and conv kernels, 0.5 / sqrt(fan-in)
                param.copy_(0.5 * noise / math.sqrt(param.numel() // param.shape[0]))
            elif name.endswith(("layernorm.weight", "norm.weight")):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith((".scale", ".gamma")):
                param.copy_(0.5 * noise)
            else:                     # biases, SnakeBeta alpha and beta (logs)
                param.copy_(0.2 * noise)
        last_conv = model.decoder[-1].conv
        last_conv.weight.mul_(10)     # a waveform of std ~0.2
    return model.eval()


def random_codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.codebook_size, (batch, CONFIG.num_quantizers, frames), generator=gen)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, reference): ours loaded by name from the reference's save_pretrained folder."""
    hf_config = Qwen3OmniMoeCode2WavConfig(**hf_config_dict(CONFIG))
    torch.manual_seed(0)
    reference = randomize(hf_modeling.Qwen3OmniMoeCode2Wav(hf_config), seed=1)
    folder = tmp_path_factory.mktemp("code2wav")
    reference.save_pretrained(folder)
    ours = Code2Wav(CONFIG).eval()
    ours.load_state_dict(safetensors_torch.load_file(folder / "model.safetensors"), strict=True)
    return ours, reference


@pytest.fixture(scope="module")
def long_codes():
    """Long enough that later chunks get less context than all previous frames."""
    frames = 3 * exact_left_context(CONFIG) + 7
    return random_codes(2, frames, seed=5)


@pytest.fixture(scope="module")
def whole(pair, long_codes):
    ours, _ = pair
    with torch.no_grad():
        return ours(long_codes)


# ---------------------------------------------------------------- whole decode


@pytest.mark.parametrize("frames", [1, 2, 5, 37])
def test_forward_matches_transformers(pair, frames):
    ours, reference = pair
    codes = random_codes(2, frames, seed=frames)
    with torch.no_grad():
        expected = reference(codes)
        out = ours(codes)
    assert out.shape == expected.shape == (2, 1, emitted_samples(CONFIG, frames))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_forward_with_the_snake_kernel_matches_transformers(pair, monkeypatch):
    # SnakeBeta as one Triton pass (CUDA's path, here in the interpreter), strided rows included
    pytest.importorskip("triton")
    from omniwalk.kernels import snac

    monkeypatch.setattr(snac, "use_triton", lambda x: True)
    ours, reference = pair
    codes = random_codes(2, 9, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(ours(codes), reference(codes), atol=ATOL, rtol=0)


def test_waveform_is_in_range_and_not_degenerate(whole):
    # the parity tests mean little if the random model outputs silence or a clipped square wave
    assert 0.05 < whole.std() < 0.6
    assert (whole.abs() == 1).float().mean() < 0.05


# ---------------------------------------------------------------- chunks


@pytest.mark.parametrize("schedule", [[4, 16], [1, 2, 1, 13], [3, 7, 2], [4, 16, 5, 30], [1000]])
def test_chunks_equal_whole_decode_at_every_seam(pair, long_codes, whole, schedule):
    ours, _ = pair
    with torch.no_grad():
        chunks = ours.decode_in_chunks(long_codes, schedule)
    start, starts, sizes = 0, [], []
    while start < long_codes.shape[-1]:
        size = min(schedule[min(len(starts), len(schedule) - 1)], long_codes.shape[-1] - start)
        starts.append(start)
        sizes.append(size)
        start += size
    assert [c.shape[-1] for c in chunks] == [chunk_samples(CONFIG, s, n) for s, n in zip(starts, sizes)]
    torch.testing.assert_close(torch.cat(chunks, dim=-1), whole, atol=ATOL, rtol=0)


def test_transformers_chunked_decode_drops_the_lookahead_at_each_seam(pair, long_codes, whole):
    """transformers' chunked_decode decodes each chunk alone from its context: every chunk
    lacks the D samples before its start, which need the chunk's first frame. With enough
    context it is exactly the whole decode less those D samples at each seam."""
    _, reference = pair
    chunk, D = 16, lookahead_samples(CONFIG)
    with torch.no_grad():
        chunked = reference.chunked_decode(long_codes, chunk_size=chunk, left_context_size=exact_left_context(CONFIG))
    frames = long_codes.shape[-1]
    num_chunks = math.ceil(frames / chunk)
    assert chunked.shape[-1] == frames * U - num_chunks * D       # generate's `samples_lost_per_chunk` is D
    seams = range(chunk, frames, chunk)
    kept = torch.ones(whole.shape[-1], dtype=torch.bool)
    for seam in seams:
        kept[seam * U - D: seam * U] = False
    torch.testing.assert_close(chunked, whole[..., kept], atol=ATOL, rtol=0)


def test_chunk_needs_context_to_redecode_the_held_back_samples(pair, long_codes):
    ours, _ = pair
    with pytest.raises(ValueError, match="context"):
        ours.decode_chunk(long_codes[..., 8:12], start_frame=8, num_context_frames=0)
    with pytest.raises(ValueError):
        ours.decode_chunk(long_codes[..., :4], start_frame=0, num_context_frames=4)   # no new frames


# ---------------------------------------------------------------- a step's chunks in one batch

L, C = exact_left_context(CONFIG), conv_context_frames(CONFIG)

#: (stream row of long_codes, start, new frames, context): first chunks, chunks inside the
#: conv context (start < C; two of them 4 frames long like a first one), one whose
#: transformer context is still growing (start < L), full-context ones, short final ones,
#: and two with less context than exact (a shorter history: equal to their own decode
#: alone, not to the whole one; the second also short of the conv context)
MIXED = [(0, 0, 4, 0), (1, 0, 1, 0), (0, 4, 16, 4), (1, 1, 2, 1), (1, 3, 1, 3), (0, 20, 16, 20),
         (1, 40, 16, L), (0, 52, 3, L), (1, 60, 1, L), (0, 36, 16, L), (1, 70, 16, C), (0, 30, 5, 9)]


def mixed_chunks(long_codes):
    assert 4 < C < 20 < L and 70 + 16 <= long_codes.shape[-1]   # the mix covers what it says
    return [CodecChunk(long_codes[row, :, start - context: start + n], start, context)
            for row, start, n, context in MIXED]


class Passes:
    """Counts transformer and conv stack passes of a Code2Wav (forward hooks)."""

    def __init__(self, model: Code2Wav):
        self.transformer = self.conv_stack = 0
        self.hooks = [model.pre_transformer.register_forward_hook(lambda *_: self.count("transformer")),
                      model.upsample[0][0].register_forward_hook(lambda *_: self.count("conv_stack"))]

    def count(self, name):
        setattr(self, name, getattr(self, name) + 1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def test_mixed_chunks_in_one_batch_equal_each_alone_and_the_whole_decode(pair, long_codes, whole):
    ours, _ = pair
    chunks = mixed_chunks(long_codes)
    with torch.no_grad(), Passes(ours) as passes:
        batched = ours.decode_chunks(chunks)
    # one transformer pass; conv passes: the six with the full conv context together, the
    # others (they see their window's frame 0) one per length: 4 (two chunks), 1, 20, 3, 14
    assert (passes.transformer, passes.conv_stack) == (1, 6)
    with torch.no_grad():
        alone = [ours.decode_chunk(chunk.codes[None], chunk.start_frame, chunk.num_context_frames)[0, 0]
                 for chunk in chunks]
    for (row, start, n, context), got, expected in zip(MIXED, batched, alone):
        assert got.shape == expected.shape == (chunk_samples(CONFIG, start, n),)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        if context == min(start, L):   # exact context: the whole decode's samples
            first = emitted_samples(CONFIG, start)
            torch.testing.assert_close(got, whole[row, 0, first: first + got.shape[-1]], atol=ATOL, rtol=0)
        else:                          # a shorter history shows: the comparison above can fail
            first = emitted_samples(CONFIG, start)
            assert (got - whole[row, 0, first: first + got.shape[-1]]).abs().max() > 10 * ATOL


def test_padding_frames_never_reach_real_ones(pair, long_codes):
    """Left padding of any codes, masked by real_from, leaves the real frames' transformer
    outputs as without it (each row at its own positions); unmasked, it would not."""
    ours, _ = pair
    real = [long_codes[0, :, 40: 40 + L + 5], long_codes[1, :, 3: 3 + 9]]     # at frames 40... and 3...
    pads = [7, L + 3]
    outputs = []
    with torch.no_grad():
        alone = [ours.hidden_states(codes[None], first_position=first)[0] for codes, first in zip(real, (40, 3))]
        for seed in (11, 12):   # two different garbages in the padding
            garbage = random_codes(2, L + 12, seed=seed)
            for row, (codes, pad) in enumerate(zip(real, pads)):
                garbage[row, :, pad:] = codes
            positions = torch.tensor([40 - pads[0], 3 - pads[1]])
            outputs.append(ours.hidden_states(garbage, positions, real_from=torch.tensor(pads)))
        unmasked = ours.hidden_states(garbage, positions)
    for out in outputs:
        for row, (codes, pad) in enumerate(zip(real, pads)):
            torch.testing.assert_close(out[row, pad:], alone[row], atol=ATOL, rtol=0)
    assert (unmasked[0, pads[0]:] - alone[0]).abs().max() > 1e-3


def test_transformer_computes_only_the_rows_the_outputs_read(pair, long_codes):
    """keep_last k: layer i of N computes the last k + (N - 1 - i) * (W - 1) rows, and the
    outputs equal the last k of the full pass."""
    ours, _ = pair
    codes = long_codes[:, :, :L + 9]
    N, W = CONFIG.num_hidden_layers, CONFIG.sliding_window
    with torch.no_grad():
        full = ours.hidden_states(codes, first_position=5)
        for keep in (1, C + 4, L - 3, L + 9, 1000):
            rows = []
            hooks = [layer.register_forward_hook(lambda m, i, out: rows.append(out.shape[1]))
                     for layer in ours.pre_transformer.layers]
            try:
                trimmed = ours.hidden_states(codes, first_position=5, keep_last=keep)
            finally:
                for hook in hooks:
                    hook.remove()
            assert rows == [min(L + 9, keep + (N - 1 - i) * (W - 1)) for i in range(N)]
            torch.testing.assert_close(trimmed, full[:, -min(keep, L + 9):], atol=ATOL, rtol=0)


def test_executor_decodes_a_step_of_calls_as_each_alone(pair, long_codes, whole):
    """Code2WavExecutor over the chunks a LeftContext edge releases for two streams at
    different points (a first chunk next to later ones, a short final one): one transformer
    pass a step, each call's PCM its chunk's decode alone, and a stream's PCM, concatenated,
    the whole decode's."""
    ours, _ = pair
    policy = LeftContext(6, L, first_size=2)
    streams = []
    for row in range(2):
        buffer = StreamBuffer(policy)
        buffer.push([tuple(frame) for frame in long_codes[row].T.tolist()])
        buffer.close()
        streams.append([chunk for chunk in iter(buffer.pop_ready, None) if chunk.num_new])
    executor = Code2WavExecutor(ours)
    pcm = {0: [], 1: []}
    lag = 3    # stream 1 starts 3 steps later: its first chunks share steps with stream 0's later ones
    for step in range(max(len(streams[0]), len(streams[1]) + lag)):
        calls = [(row, streams[row][step - shift]) for row, shift in ((0, 0), (1, lag))
                 if 0 <= step - shift < len(streams[row])]
        with Passes(ours) as passes:
            outputs = executor.run([NodeCall(stream=None, inputs={"frames": chunk}, num_tokens=1)
                                    for _, chunk in calls])
        assert passes.transformer == 1    # the step's calls in one batch
        for (row, chunk), output in zip(calls, outputs):
            context = len(chunk.items) - chunk.num_new
            with torch.no_grad():
                alone = ours.decode_chunk(long_codes[row:row + 1, :, chunk.start: chunk.start + len(chunk.items)],
                                          chunk.start + context, context)[0, 0]
            got = np.frombuffer(output["pcm"], dtype=np.int16)
            assert got.shape == alone.shape
            # int16 rounding of the same float: at most one step apart
            assert np.abs(got.astype(np.int32) - pcm16(alone)).max() <= 1
            pcm[row].append(got)
    for row in range(2):
        stream = np.concatenate(pcm[row]).astype(np.int32)
        assert stream.shape == (emitted_samples(CONFIG, long_codes.shape[-1]),)
        assert np.abs(stream - pcm16(whole[row, 0])).max() <= 1


def pcm16(wav: torch.Tensor) -> np.ndarray:
    return (wav.float() * 32767).round().to(torch.int32).numpy()


# ---------------------------------------------------------------- sample counts and receptive field


def test_sample_counts_of_the_released_model():
    config = Code2WavConfig()
    assert config.samples_per_frame == 1920                   # 80 ms at 24 kHz
    assert lookahead_samples(config) == 480 + 60 + 12 + 3 == 555
    assert transformer_context_frames(config) == 8 * 71
    assert conv_context_frames(config) == 10
    assert exact_left_context(config) == 578
    assert emitted_samples(config, 1) == 1920 - 555
    assert chunk_samples(config, 0, 4) == 4 * 1920 - 555      # a first chunk of 4 frames
    assert chunk_samples(config, 4, 16) == 16 * 1920          # every later chunk: n * U
    starts = [0, 4, 20, 36]
    sizes = [4, 16, 16, 9]
    assert sum(chunk_samples(config, s, n) for s, n in zip(starts, sizes)) == emitted_samples(config, 45)


def changed(a: torch.Tensor, b: torch.Tensor, tol: float) -> tuple[int, int]:
    """First and last index along the last dim where a and b differ (batch 1, one channel)."""
    where = ((a - b).abs().flatten(0, -2).amax(0) > tol).nonzero().flatten()
    return int(where[0]), int(where[-1])


def test_conv_stack_reach_matches_the_index_arithmetic(pair):
    """A change to one hidden frame f moves samples [f*U - D, ...]: it reaches back D samples
    (the lookahead) and forward to the last sample whose first frame read is f, which is
    C frames on (the conv context)."""
    ours = copy.deepcopy(pair[0]).double()
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 60, CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    f = 30
    bumped = hidden.clone()
    bumped[:, f] += torch.randn(CONFIG.hidden_size, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        # tolerance 0, in float64: at the far edge the change has decayed through every conv to
        # ~1e-7, which float32 rounding may or may not keep, depending on the conv algorithm
        first, last = changed(ours.waveform(hidden), ours.waveform(bumped), tol=0)
    D, C = lookahead_samples(CONFIG), conv_context_frames(CONFIG)
    assert first == f * U - D
    # sample (f + C) * U - D is the first a chunk starting at frame f + C emits: it reads frame f;
    # nothing after the next frame's share does
    assert (f + C) * U - D <= last < (f + C + 1) * U - D


def test_transformer_reach_is_layers_times_window(pair):
    ours, _ = pair
    codes = random_codes(1, 60, seed=8)
    f = 10
    bumped = codes.clone()
    bumped[:, :, f] = (bumped[:, :, f] + 1) % CONFIG.codebook_size
    with torch.no_grad():
        a, b = ours.hidden_states(codes), ours.hidden_states(bumped)
    first, last = changed(a.transpose(1, 2), b.transpose(1, 2), tol=1e-6)
    assert (first, last) == (f, f + transformer_context_frames(CONFIG))


# ---------------------------------------------------------------- config


def test_config_from_full_qwen3_omni_config():
    full = Qwen3OmniMoeConfig(code2wav_config=hf_config_dict(CONFIG)).to_dict()
    assert Code2WavConfig.from_hf(full) == CONFIG
    assert Code2WavConfig.from_hf(full["code2wav_config"]) == CONFIG
    assert Code2WavConfig.from_hf(Qwen3OmniMoeConfig().to_dict()) == Code2WavConfig()


def test_config_from_a_released_style_dict():
    """Released config.json files spell `rope_theta` and carry quantizer keys the decoder ignores."""
    released = {"codebook_dim": 512, "codebook_size": 2048, "decoder_dim": 1536, "hidden_size": 1024,
                "intermediate_size": 3072, "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000,
                "model_type": "", "num_attention_heads": 16, "num_hidden_layers": 8, "num_key_value_heads": 16,
                "num_quantizers": 16, "num_semantic_quantizers": 1, "rms_norm_eps": 1e-05, "rope_theta": 10000,
                "semantic_codebook_size": 4096, "sliding_window": 72, "upsample_rates": [8, 5, 4, 3],
                "upsampling_ratios": [2, 2], "vector_quantization_hidden_dimension": 512}
    config = Code2WavConfig.from_hf({"code2wav_config": released})
    assert config == Code2WavConfig()
    assert config.upsample_rates == (8, 5, 4, 3) and config.rope_theta == 10000.0


def test_config_refuses_what_the_decoder_cannot_run():
    with pytest.raises(ValueError, match="rope_type"):
        Code2WavConfig.from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        dataclasses.replace(CONFIG, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_act"):
        dataclasses.replace(CONFIG, hidden_act="gelu")
