"""Orpheus TTS: SNAC parity with the `snac` package, the token layout, the speech budget
contract (exact code counts, documented sample counts, stream == collected bytes), many
concurrent requests, the end-of-speech stop, and loading a local checkpoint folder."""

from __future__ import annotations

import functools
import gc
import json
import weakref
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omniwalk import Engine, EngineArgs
from omniwalk.graph import interpret_request
from omniwalk.runtime import FunctionExecutor, Request, Runtime, StopConfig, StreamParams
from omniwalk.runtime.streams import RequestState, StreamState
from omniwalk.models.orpheus.config import (
    CODES_PER_FRAME, ORPHEUS_3B, TINY_SNAC, TINY_TOKENS, VOICES, samples_per_frame,
)
from omniwalk.models.orpheus.model import (
    HostPCM, OrpheusPrompt, SnacDecoderExecutor, Window, complete_frames, noise_key, orpheus_graph, orpheus_plan,
    samples_received,
)
from omniwalk.models.orpheus.snac import (
    SNAC_24KHZ, SeededNoise, SnacConfig, SnacDecoder, init_random_snac, load_snac_state, torch_global_noise,
)
from omniwalk.capabilities import Capability
from omniwalk.capabilities.speech import SpeechRequest, collect_speech, synthesize

TOKENIZER_DIR = Path(__file__).parents[2] / "omniwalk" / "models" / "assets" / "tiny-tokenizer"


# ---------------------------------------------------------------- SNAC


def reference_snac(config: SnacConfig, seed: int = 0):
    """`snac.SNAC` with random weights; Snake alphas and biases randomized too, so that
    every parameter kind matters to the comparison."""
    snac = pytest.importorskip("snac")
    torch.manual_seed(seed)
    model = snac.SNAC(**config.to_dict()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".alpha"):
                param.uniform_(0.5, 2.0)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    return model


def random_codes(config: SnacConfig, rows: int, frames: int) -> list[torch.Tensor]:
    top = config.vq_strides[0]
    return [torch.randint(0, config.codebook_size, (rows, frames * top // s)) for s in config.vq_strides]


@pytest.mark.parametrize("config", [
    TINY_SNAC,
    replace(TINY_SNAC, noise=False, depthwise=False),
    pytest.param(SNAC_24KHZ, marks=pytest.mark.slow),
], ids=["tiny", "tiny-plain", "snac_24khz"])
def test_snac_decoder_matches_the_snac_package(config):
    reference = reference_snac(config)
    ours = SnacDecoder(config)
    load_snac_state(ours, reference.state_dict())    # parametrizations.weight.original0/1 names
    rows, frames = (3, 4) if config is not SNAC_24KHZ else (1, 2)
    codes = random_codes(config, rows, frames)
    with torch.inference_mode():
        torch.manual_seed(1)
        expected = reference.decode(codes)
        torch.manual_seed(1)    # the same noise draws, in the same order
        got = ours(codes, torch_global_noise)
    assert got.shape == expected.shape == (rows, 1, frames * samples_per_frame(config))
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std().item() > 1e-3     # not a trivially silent comparison


@pytest.mark.parametrize("config", [TINY_SNAC, replace(TINY_SNAC, decoder_rates=(3, 2, 2)),
                                    pytest.param(SNAC_24KHZ, marks=pytest.mark.slow)],
                         ids=["tiny", "tiny-odd-rate", "snac_24khz"])
def test_a_part_of_a_window_decodes_alone_to_the_same_samples(config):
    """`keep`: only samples [a, b), from the least input that determines them. In float64
    the samples equal the whole decode's to rounding (a plan one step short would be off
    by O(1) there); against the `snac` package in fp32, the window's centre within 1e-4."""
    frame = samples_per_frame(config)
    decoder = SnacDecoder(config).double().eval()
    init_random_snac(decoder, seed=4)
    codes = random_codes(config, 2, 4)

    def noise(index, x, start=0, total=None):   # SeededNoise, computed in fp32 as served, then float64
        return SeededNoise([5, 6])(index, x.float(), start, total).double()

    with torch.inference_mode():
        whole = decoder(codes, noise)[:, 0]
        for keep in ((frame, 2 * frame), (0, 2 * frame), (2 * frame, 4 * frame), (frame + 7, 3 * frame - 5)):
            part = decoder(codes, noise, keep)[:, 0]
            assert part.shape == (2, keep[1] - keep[0])
            assert (part - whole[:, keep[0]:keep[1]]).abs().max().item() < 1e-9
    if config is SNAC_24KHZ:   # the blocks' input steps a centre needs: 15 of 16, 48 of 128, 288 of 1024, 1068 of 4096
        assert decoder.decoder.crop_plan(16, (frame, 2 * frame)) == [(0, 15), (24, 72), (240, 528), (1002, 2070)]
        reference = reference_snac(config)
        ours = SnacDecoder(config)
        load_snac_state(ours, reference.state_dict())
        with torch.inference_mode():
            torch.manual_seed(1)
            expected = reference.decode(codes)[:, 0, frame:2 * frame]
            torch.manual_seed(1)
            got = ours(codes, torch_global_noise, (frame, 2 * frame))[:, 0]
        assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_snac_with_its_triton_kernels_matches_the_snac_package(monkeypatch):
    """The CUDA path's kernels (Snake, depthwise conv with and without a Snake after it,
    1x1 conv with the residual add or the noise or neither, short transposed convs as a
    GEMM), in Triton's interpreter here, inside the whole decoder; the depthwise conv module
    and the transposed convs as a GEMM alone (the kernels alone: tests/kernels/test_snac.py)."""
    pytest.importorskip("triton")
    from omniwalk.kernels import snac as snac_ops
    from omniwalk.models.orpheus.snac import DepthwiseConv1d, UpsampleBlock
    monkeypatch.setattr(snac_ops, "use_triton", lambda x: True)
    reference = reference_snac(TINY_SNAC, seed=3)
    ours = SnacDecoder(TINY_SNAC)
    load_snac_state(ours, reference.state_dict())
    codes = random_codes(TINY_SNAC, 1, 3)   # the interpreter's cost grows with the rows
    with torch.inference_mode():
        torch.manual_seed(1)
        expected = reference.decode(codes)
        torch.manual_seed(1)
        got = ours(codes, torch_global_noise)
        frame = samples_per_frame(TINY_SNAC)   # a window's middle alone (cropped, non-contiguous inputs)
        torch.manual_seed(1)
        middle = ours(codes, torch_global_noise, (frame, 2 * frame))
    assert (got - expected).abs().max().item() < 1e-4 and expected.std().item() > 1e-3
    assert (middle - expected[:, :, frame:2 * frame]).abs().max().item() < 1e-4
    x = torch.randn(2, 5, 37) * 3
    for dilation in (1, 3, 9):   # windows reaching past both ends of a short input
        conv = DepthwiseConv1d(5, 7, dilation)
        expected = torch.nn.functional.conv1d(x, conv.weight, conv.bias, padding=3 * dilation, dilation=dilation,
                                              groups=5)
        torch.testing.assert_close(conv(x), expected, atol=1e-5, rtol=1e-5)
    # short transposed convs as a GEMM + overlap-add: SNAC's rates and an odd one, channels off the blocks
    for channels_in, channels_out, rate, length in ((40, 20, 8, 5), (24, 70, 4, 9), (17, 9, 2, 32), (6, 5, 3, 7)):
        block = UpsampleBlock(channels_in, channels_out, rate, noise=False, groups=channels_out)
        x_in = torch.randn(3, channels_in, length)
        with torch.inference_mode():
            got, expected_up = block._upsample_as_gemm(block.block[1], x_in), block.block[1](x_in)
        assert got.shape == expected_up.shape == (3, channels_out, length * rate)
        torch.testing.assert_close(got, expected_up, atol=1e-4, rtol=1e-5)


def test_snac_loads_old_weight_norm_names():
    reference = reference_snac(TINY_SNAC)
    old_names = {}
    for name, tensor in reference.state_dict().items():
        name = name.replace(".parametrizations.weight.original0", ".weight_g")
        old_names[name.replace(".parametrizations.weight.original1", ".weight_v")] = tensor
    new, old = SnacDecoder(TINY_SNAC), SnacDecoder(TINY_SNAC)
    load_snac_state(new, reference.state_dict())
    load_snac_state(old, old_names)
    for (name, a), (_, b) in zip(new.named_parameters(), old.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="missing"):
        load_snac_state(new, {k: v for k, v in reference.state_dict().items() if "decoder.model.0" not in k})


def test_seeded_noise_is_batch_invariant_and_reproducible():
    decoder = SnacDecoder(TINY_SNAC)
    init_random_snac(decoder, seed=5)
    codes = random_codes(TINY_SNAC, 3, 4)
    keys = [11, 22, 33]
    with torch.inference_mode():
        together = decoder(codes, SeededNoise(keys))
        alone = [decoder([c[i:i + 1] for c in codes], SeededNoise([keys[i]])) for i in range(3)]
        again = decoder(codes, SeededNoise(keys))
    assert torch.equal(together, again)
    x = torch.zeros(3, 8, 50)
    for i in range(3):   # the noise itself is a function of the row's key alone, exactly
        assert torch.equal(SeededNoise(keys)(2, x)[i], SeededNoise([keys[i]])(2, x[i:i + 1])[0])
        # the convolutions of a batch of 3 and of 1 may round differently on CPU
        torch.testing.assert_close(together[i:i + 1], alone[i], atol=2e-5, rtol=0)
    assert 0.05 < together.std().item() < 0.9     # audible, not clipped: byte comparisons mean something


# ---------------------------------------------------------------- token layout


def test_orpheus_token_layout():
    t = ORPHEUS_3B
    assert (t.start_of_speech, t.end_of_speech, t.start_of_human, t.end_of_human, t.start_of_ai, t.end_of_ai) == \
        (128257, 128258, 128259, 128260, 128261, 128262)
    assert t.audio_start == 128266 and t.audio_end == 128266 + 7 * 4096
    # the reference: code = int(N) - 10 - (index % 7) * 4096 for <custom_token_N>, id = 128256 + N
    for position in range(7):
        for code in (0, 1, 4095):
            token = t.code_id(code, position)
            assert t.code_of(token, position) == (token - 128256) - 10 - position * 4096 == code
    with pytest.raises(ValueError):
        t.code_of(t.code_id(5, 1), 2)     # a code of another frame position
    frames = [t.code_id(code, i % 7) for i, code in enumerate([0, 4095, 7, 1, 2, 3, 9] * 2)]
    assert list(t.codes_of(frames)) == [t.code_of(token, i % 7) for i, token in enumerate(frames)]
    with pytest.raises(ValueError, match="frame position 2"):
        t.codes_of(frames[:9] + [t.code_id(5, 1)])   # index 9: position 2
    with pytest.raises(ValueError):
        t.codes_of([t.end_of_speech])
    assert t.prompt_ids([128000, 7, 8]) == [128259, 128000, 7, 8, 128009, 128260, 128261, 128257]
    assert "tara" in VOICES and len(VOICES) == 8


# ---------------------------------------------------------------- the plan, runtime vs interpreter


@pytest.mark.parametrize("stop_at", [None, 30, 34])
def test_every_complete_frame_is_emitted_once_in_order(stop_at):
    """Toy nodes on the real graph and plan: the backbone emits code i at step i (or the
    stop id at `stop_at`); the decoder returns the frame numbers it emits. The runtime and
    the reference interpreter agree, and the frames are exactly 0 .. F-1."""
    tokens = TINY_TOKENS

    def backbone(state, inputs):
        step = state["step"] = state.get("step", -1) + 1
        token = tokens.end_of_speech if step == stop_at else tokens.code_id(step % 64, step % 7)
        return {"token": token}

    def decoder(state, inputs):
        first, end = inputs["emit"]
        return {"pcm": [inputs["window"].first_frame + f for f in range(first, end)]}

    graph = orpheus_graph()
    functions = {"backbone": backbone, "snac_decoder": decoder}
    plan = functools.partial(orpheus_plan, tokens)
    model = SimpleNamespace(graph=graph, plan=plan,
                            executors={name: FunctionExecutor(fn, max_batch_size=3) for name, fn in functions.items()})
    runtime = Runtime(model)
    stop = StopConfig(eos_ids=frozenset({tokens.end_of_speech}))
    prompt = OrpheusPrompt([1, 2, 3])
    budgets = range(1, 50)
    for n in budgets:   # all at once: the toy nodes run batches of up to 3 streams
        runtime.add_request(Request(f"r{n}", prompt, {"codes": StreamParams(n, stop), "audio": StreamParams()}))
    audio: dict[str, list] = {}
    while runtime.has_unfinished:
        for out in runtime.step():
            audio.setdefault(out.request_id, []).extend(out.items.get(("audio", "audio"), []))
    for n in budgets:
        expected = interpret_request(graph, plan, functions, prompt, limits={"codes": n},
                                     stop_items={"codes": {tokens.end_of_speech}})
        emitted = [f for pcm in expected["audio"].outputs["audio"] for f in pcm]
        codes = n if stop_at is None or stop_at >= n else stop_at
        assert emitted == list(range(complete_frames(codes)))
        assert [f for pcm in audio[f"r{n}"] for f in pcm] == emitted


# ---------------------------------------------------------------- speech through the engine


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineArgs("tiny-orpheus", max_num_batched_tokens=256)) as engine:
        yield engine


def speech(n: int, seed: int = 11, **kw) -> SpeechRequest:
    fields = dict(max_output_tokens=n, ignore_eos=True, temperature=1.0, seed=seed)
    fields.update(kw)
    return SpeechRequest("The river ran past the old mill.", **fields)


def expected_pcm(engine, token_ids: list[int], seed: int) -> bytes:
    """The documented chunking, written out independently of the model's plan: frame 0-1
    from the first 4-frame window, each later window's centre (samples S:2S, as the
    reference decoder), the last window's frames 2-3 at the end; F < 4: all at once."""
    model = engine.model
    frame = model.frame_samples
    codes = [model.tokens.code_of(t, i % 7) for i, t in enumerate(token_ids) if t != model.tokens.end_of_speech]
    num_frames = len(codes) // 7

    def decode(first: int, count: int) -> np.ndarray:
        f = torch.tensor(codes[first * 7:(first + count) * 7]).view(1, count, 7)
        levels = [f[:, :, 0], f[:, :, [1, 4]].flatten(1), f[:, :, [2, 3, 5, 6]].flatten(1)]
        with torch.inference_mode():
            audio = model.snac(levels, SeededNoise([noise_key(seed, first)]))[0, 0]
        return (audio * 32767).to(torch.int16).numpy()

    if num_frames == 0:
        return b""
    if num_frames < 4:
        return decode(0, num_frames).astype("<i2").tobytes()
    parts = [decode(0, 4)[: 2 * frame]]
    parts += [decode(end - 3, 4)[frame: 2 * frame] for end in range(4, num_frames)]
    parts.append(decode(num_frames - 4, 4)[2 * frame:])
    return np.concatenate(parts).astype("<i2").tobytes()


def assert_audio_codes(engine, token_ids: list[int]) -> None:
    tokens = engine.model.tokens
    for index, token in enumerate(token_ids):
        tokens.code_of(token, index % CODES_PER_FRAME)    # raises if not a code of that position


@pytest.mark.parametrize("n", [1, 7, 8, 28, 29, pytest.param(200, marks=pytest.mark.slow)])
def test_exactly_n_codes_and_the_documented_samples(engine, n):
    before = dict(engine.stats.walk_counts)
    result = synthesize(engine, speech(n))
    chunks = list(engine.submit(speech(n)))

    assert len(result.token_ids) == n and result.finish_reason == "length"
    assert_audio_codes(engine, result.token_ids)
    frames = n // 7                               # a partial frame is dropped, never padded
    usage = result.usage
    assert (usage.output_tokens, usage.codes, usage.frames) == (n, n, frames)
    assert usage.samples == len(result.pcm) // 2 == samples_received(frames, engine.frontend(Capability.SPEECH).frame_samples)
    assert samples_received(frames) == frames * 2048    # snac_24khz's frame: 4 latent steps x 512

    # streamed == collected, byte for byte; and the bytes are the documented windows
    assert b"".join(c.pcm for c in chunks) == result.pcm
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert chunks[-1].finished and chunks[-1].usage == usage
    assert all(c.pcm for c in chunks[:-1])       # codes alone wait for the next audio chunk
    assert result.pcm == expected_pcm(engine, result.token_ids, seed=11)

    walks = {k: v - before.get(k, 0) for k, v in engine.stats.walk_counts.items()}
    assert walks["prefill"] == 2
    assert walks.get("decode", 0) == (0 if n == 1 else 2)    # N = 1 ends at its prefill
    if n >= 200:   # streaming: audio arrives while codes are still being generated
        first_audio = next(i for i, c in enumerate(chunks) if c.pcm)
        assert first_audio < len(chunks) - 1 and not chunks[first_audio].finished


def test_partial_frames_add_no_audio(engine):
    for whole, partial in ((7, 8), (28, 29), (28, 34)):
        a, b = synthesize(engine, speech(whole)), synthesize(engine, speech(partial))
        assert b.token_ids[:whole] == a.token_ids
        assert b.pcm == a.pcm and b.usage.frames == a.usage.frames


@pytest.mark.slow
def test_32_concurrent_speech_requests(engine):
    budgets = [1 + (i * 13) % 90 for i in range(32)]
    walks, batches = engine.stats.walk_counts.get("vocode", 0), engine.stats.node_batches.get("snac_decoder", 0)
    streams = [engine.submit(speech(n, seed=100 + i)) for i, n in enumerate(budgets)]
    results = [collect_speech(stream) for stream in streams]
    walks = engine.stats.walk_counts.get("vocode", 0) - walks
    assert engine.stats.node_batches.get("snac_decoder", 0) - batches < walks    # windows of several requests per forward
    frame = engine.frontend(Capability.SPEECH).frame_samples
    for i, (n, result) in enumerate(zip(budgets, results)):
        assert result.error is None and result.finish_reason == "length"
        assert len(result.token_ids) == n and result.usage.codes == n
        assert len(result.pcm) // 2 == result.usage.samples == samples_received(n // 7, frame)
        # batched SNAC windows give what this request's windows give alone (to 1 LSB)
        alone = np.frombuffer(expected_pcm(engine, result.token_ids, seed=100 + i), dtype="<i2").astype(int)
        batched = np.frombuffer(result.pcm, dtype="<i2").astype(int)
        assert np.abs(alone - batched).max(initial=0) <= 1


def test_finished_speech_requests_leave_no_garbage_cycles(engine):
    # their windows and pinned PCM go with them by reference counting, not at a full
    # collection (which the engine makes rare); executors keep their last batch's rows
    # until the next batch, so the first requests are checked after later ones ran
    def run(budgets):
        results = [collect_speech(stream) for stream in
                   [engine.submit(speech(n, seed=n)) for n in budgets]]
        assert [len(result.token_ids) for result in results] == budgets
        return [weakref.ref(o) for o in gc.get_objects()
                if isinstance(o, (StreamState, RequestState, Window, HostPCM))]

    gc.collect()
    gc.disable()
    try:
        first = run([1, 40])
        assert first   # the check below can fail
        run([30])
        assert [ref() for ref in first if ref() is not None] == []
    finally:
        gc.enable()


@pytest.mark.slow
def test_startup_warmup_decodes_speech_and_changes_no_output(record_batch_sizes):
    """Orpheus' warm-up requests sample codes and decode SNAC windows before serving; the
    engine is then as clean as one that did not warm up: the same audio for a seeded request."""
    results, windows = {}, record_batch_sizes(SnacDecoderExecutor)
    for warmup in (False, True):
        windows.clear()
        with Engine(EngineArgs("tiny-orpheus", startup_warmup=warmup, max_num_batched_tokens=256)) as engine:
            # the eight warm-up requests of five frames: windows at codes 28 and 35, then the flush
            assert sum(windows) == (24 if warmup else 0)
            assert not engine.runtime.running and not engine.runtime.walk_counts
            cache = engine.model.cache
            assert cache.allocator.num_free == cache.allocator.num_pages and not cache.page_tables
            results[warmup] = synthesize(engine, speech(40, seed=3))
    assert results[True].pcm == results[False].pcm and len(results[True].pcm) > 0


def test_end_of_speech_stops_and_is_never_audio(engine, monkeypatch):
    # With top_p = 1 the sampler's race picks the same code whether or not end_of_speech
    # may compete, so the stopped run is the free run cut at the first stop it samples.
    eos = engine.model.tokens.end_of_speech
    plan, audio_inputs = engine.model.plan, []

    def recording_plan(view):
        if view.name == "audio" and view.chunk is not None:
            audio_inputs.extend(view.chunk.items)
        return plan(view)

    free = synthesize(engine, speech(200, seed=13, top_p=1.0))
    monkeypatch.setattr(engine.model, "plan", recording_plan)
    stopped = synthesize(engine, speech(200, seed=13, top_p=1.0, ignore_eos=False))
    monkeypatch.undo()
    assert audio_inputs and eos not in audio_inputs      # the stop item never reaches the audio stream
    assert stopped.finish_reason == "stop", "seed 13 no longer samples end_of_speech within 200 codes"
    k = len(stopped.token_ids) - 1
    assert k % 7 and k >= 28        # a partial frame before the stop, and streamed windows
    assert stopped.token_ids == free.token_ids[:k] + [eos]
    assert stopped.usage.output_tokens == k + 1 and stopped.usage.codes == k
    assert stopped.usage.samples == samples_received(k // 7, engine.frontend(Capability.SPEECH).frame_samples)
    same_codes = synthesize(engine, speech(k, seed=13, top_p=1.0))
    assert stopped.pcm == same_codes.pcm      # the stop item added nothing
    streamed = list(engine.submit(speech(200, seed=13, top_p=1.0, ignore_eos=False)))
    assert b"".join(c.pcm for c in streamed) == stopped.pcm and streamed[-1].finish_reason == "stop"


def test_bad_speech_requests(engine):
    with pytest.raises(ValueError, match="voice"):   # the model's voices, checked by its frontend
        engine.submit(SpeechRequest("hi", voice="nobody"))
    with pytest.raises(ValueError, match="max_output_tokens"):
        SpeechRequest("hi", max_output_tokens=0)
    with pytest.raises(ValueError, match="context"):
        engine.submit(speech(10**6))


# ---------------------------------------------------------------- a local checkpoint folder


def write_orpheus_folder(folder: Path, snac_config: SnacConfig):
    """A tiny Llama with Orpheus' vocabulary (HF format), the tiny tokenizer, and a `snac`
    package checkpoint in `snac/` (parametrized weight-norm names, pytorch_model.bin)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=ORPHEUS_3B.audio_end + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for file in TOKENIZER_DIR.iterdir():
        shutil.copy(file, folder / file.name)
    reference = reference_snac(snac_config, seed=2)
    (folder / "snac").mkdir()
    (folder / "snac" / "config.json").write_text(json.dumps(snac_config.to_dict()))
    torch.save(reference.state_dict(), folder / "snac" / "pytorch_model.bin")
    return reference


def test_loads_a_local_checkpoint_and_snac_folder(tmp_path):
    snac_config = replace(TINY_SNAC, codebook_size=4096)    # the real id layout needs 4096 codes
    reference = write_orpheus_folder(tmp_path, snac_config)
    with pytest.raises(FileNotFoundError, match="SNAC"):
        Engine(EngineArgs(str(tmp_path), codec=str(tmp_path / "elsewhere")))
    with Engine(EngineArgs(str(tmp_path), kv_cache_tokens=2048)) as engine:
        assert engine.model.tokens == ORPHEUS_3B
        codes = random_codes(snac_config, 2, 3)
        with torch.inference_mode():
            torch.manual_seed(4)
            expected = reference.decode(codes)
            torch.manual_seed(4)
            got = engine.model.snac(codes, torch_global_noise)
        assert (got - expected).abs().max().item() < 1e-4
        result = synthesize(engine, speech(37, voice="leo"))
        assert len(result.token_ids) == 37 and result.usage.frames == 5
        assert_audio_codes(engine, result.token_ids)
        assert len(result.pcm) // 2 == samples_received(5, samples_per_frame(snac_config))


@pytest.mark.slow
def test_sampling_over_the_next_codebook_equals_full_vocabulary_sampling():
    """The LM head scores only the ids Orpheus may sample (end_of_speech .. the last audio
    code), and the audio-code mask names its candidates (end_of_speech + the next frame
    position's 4096 codes at Orpheus' shape), so the sampler works on those columns only;
    the codes equal sampling over the masked full vocabulary of the full LM head (Orpheus'
    default sampling: temperature, top_p and a repetition penalty)."""
    outputs = {}
    for compact in (True, False):
        with Engine(EngineArgs("tiny-orpheus", device="cpu", kv_cache_tokens=8192, max_num_seqs=4)) as e:
            mask, lm = e.model.executors["backbone"].logits_mask, e.model.lm
            assert len(lm.logit_ids) < lm.config.vocab_size
            if not compact:   # the same rule as a plain callable: the sampler sees every id
                e.model.executors["backbone"].logits_mask = lambda logits, calls, ids: mask(logits, calls, ids)
                lm.logit_ids = range(lm.config.vocab_size)
            defaults = dict(temperature=0.6, top_p=0.95, repetition_penalty=1.1)   # Orpheus' own
            requests = [speech(35, seed=s, **defaults) for s in (1, 2, 3)] + [
                speech(35, seed=4, ignore_eos=False, **defaults)]
            outputs[compact] = [synthesize(e, r).token_ids for r in requests]
    assert outputs[True] == outputs[False]
    assert all(len(ids) > 0 for ids in outputs[True])


@pytest.mark.slow
@pytest.mark.parametrize("max_windows", [64, 2])
def test_snac_graph_path_gives_the_eager_samples(max_windows):
    """Full windows through `SnacGraphs` (eager on a CPU, from the same static buffers a
    captured graph reads; keyed noise computed in the graph) give the eager decoder's PCM,
    also when a step's windows are split over several replays: within 1 LSB, because a
    bucket pads the batch and the convolutions' float rounding depends on the batch size
    (a wrong noise key or code layout moves samples by thousands)."""
    from omniwalk.models.orpheus.model import CENTRE, HEAD, TAIL, WINDOW_FRAMES
    from omniwalk.models.orpheus.snac_graphs import SnacGraphs

    requests = [speech(n, seed=s) for n, s in ((70, 1), (35, 2), (49, 3), (29, 4))]
    outputs = {}
    for graphs in (False, True):
        with Engine(EngineArgs("tiny-orpheus", device="cpu", kv_cache_tokens=8192, max_num_seqs=4)) as e:
            snac = e.model.executors["snac_decoder"]
            if graphs:   # a set per emitted frame range, as the loader captures them on CUDA
                calls = []
                frame = snac.frame_samples
                for emit in (HEAD, CENTRE, TAIL):
                    graph_set = SnacGraphs(snac.decoder, WINDOW_FRAMES, max_windows,
                                           keep=(emit[0] * frame, emit[1] * frame))
                    run = graph_set.run
                    graph_set.run = (lambda run, emit: lambda codes, keys:
                                     calls.append((emit, len(keys))) or run(codes, keys))(run, emit)
                    snac.graphs[emit] = graph_set
            streams = [e.submit(r) for r in requests]
            outputs[graphs] = [collect_speech(s) for s in streams]
    for eager, graphed in zip(outputs[False], outputs[True]):
        assert graphed.token_ids == eager.token_ids and len(graphed.pcm) == len(eager.pcm) > 0
        difference = np.frombuffer(graphed.pcm, "<i2").astype(int) - np.frombuffer(eager.pcm, "<i2").astype(int)
        assert np.abs(difference).max() <= 1
    # every set replayed, several windows at once (and split over parts when max_windows = 2)
    assert {emit for emit, _ in calls} == {HEAD, CENTRE, TAIL}
    assert len(calls) > 5 and max(n for _, n in calls) > 1
