"""Whisper: log-mel parity with WhisperFeatureExtractor, greedy ids equal to HF `generate`
(a tiny random checkpoint written with save_pretrained), the budget contract across
windows, streaming, batching across requests, cancellation and audio decoding."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import time

import numpy as np
import pytest
import torch

from omniwalk import Engine, EngineArgs
from omniwalk.audio import decode_audio, load_audio, resample
from omniwalk.models.whisper.features import FeatureConfig, LogMelFeatures
from omniwalk.capabilities.transcription import TranscriptionRequest, transcribe

transformers = pytest.importorskip("transformers")

from whisper_checkpoints import (  # noqa: E402  (tests/models is on sys.path)
    SR, clip, features, hf_generation_config, save_tiny_whisper, window_of,
)

MAX_TARGET = 128         # decoder positions of the test checkpoint: short runaway windows


CLIPS = {"sine-3s": clip("sine", 3), "chirp-11s": clip("chirp", 11), "noise-29s": clip("noise", 29)}


# ---------------------------------------------------------------- features and audio


@pytest.mark.parametrize("bins", [80, 128])
def test_log_mel_matches_whisper_feature_extractor(bins, monkeypatch):
    reference = transformers.WhisperFeatureExtractor(feature_size=bins)
    ours = LogMelFeatures(FeatureConfig(num_mel_bins=bins))
    monkeypatch.setattr(LogMelFeatures, "BLOCK_WINDOWS", 1)     # STFT blocks of one window: seams inside
    audio = np.concatenate([clip("chirp", 31), clip("noise", 20, seed=1)])     # 51 s: long-form
    frames = ours(audio)
    expected = reference(audio, sampling_rate=SR, return_tensors="np", truncation=False,
                         padding="longest").input_features[0]           # what long-form generate takes
    assert frames.frames.shape == expected.shape == (bins, 5100)
    assert np.abs(frames.frames.numpy() - expected).max() < 1e-4
    assert frames.consecutive_seeks == (0, 3000) and frames.window_length(3000) == 2100
    tail = frames.window(3000).numpy()   # the frames from 3000 on, zero-padded as generate pads a window
    assert np.array_equal(tail[:, :2100], frames.frames[:, 3000:].numpy()) and not tail[:, 2100:].any()
    for signal in CLIPS.values():   # up to 30 s: padded to one window (short-form)
        expected = reference(signal, sampling_rate=SR, return_tensors="np").input_features[0]
        assert np.abs(ours(signal).frames.numpy() - expected).max() < 1e-4


def test_audio_files_decode_to_16khz_mono():
    soundfile = pytest.importorskip("soundfile")
    def tone(rate):
        return (0.5 * np.sin(2 * np.pi * 440 * np.arange(2 * rate) / rate)).astype(np.float32)

    stereo = np.stack([tone(44100), tone(44100)], axis=1)
    for fmt, rate, data in [("WAV", 16000, tone(16000)), ("FLAC", 44100, stereo), ("MP3", 22050, tone(22050))]:
        buffer = io.BytesIO()
        soundfile.write(buffer, data, rate, format=fmt)
        samples = decode_audio(buffer.getvalue(), SR)
        assert samples.dtype == np.float32 and samples.ndim == 1
        assert abs(samples.size - 2 * SR) < 0.01 * SR, fmt   # MP3 adds codec delay/padding
        spectrum = np.abs(np.fft.rfft(samples))
        assert abs(np.argmax(spectrum) * SR / samples.size - 440) < 2, fmt
    assert np.array_equal(resample(tone(8000), 8000, 8000), tone(8000))
    for bad, message in [(b"", "empty"), (b"not audio at all", "could not decode"),
                         (np.zeros(0, np.float32), "no samples"), (np.zeros((2, 5), np.float32), "mono"),
                         (np.zeros(5, np.int16), "floating point"), ("a string", "file bytes or a numpy array")]:
        with pytest.raises(ValueError, match=message):
            load_audio(bad, SR)


# ---------------------------------------------------------------- an HF checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random WhisperForConditionalGeneration, weights x10 so greedy ids depend on the audio."""
    folder = tmp_path_factory.mktemp("tiny-whisper-hf")
    model = save_tiny_whisper(folder, MAX_TARGET)
    return folder, model, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def engine(checkpoint):
    folder, _, _ = checkpoint
    with Engine(EngineArgs(str(folder), dtype="float32", device="cpu", max_num_batched_tokens=64,
                           max_num_seqs=16)) as engine:
        yield engine


def hf_generate(model, audio, eos=None, max_new_tokens=24, **kwargs) -> list[int]:
    """HF's greedy ids after the decoder prompt (a final EOS included), of one window: a
    random model samples ids past <|notimestamps|> even without timestamps, which HF's
    long-form loop would take for timestamps (force_unique_generate_call: no loop)."""
    if not torch.is_tensor(audio):
        audio = features(audio)
    options = dict(task="transcribe", max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                   force_unique_generate_call=True)
    if eos is not None:
        options["eos_token_id"] = eos
    sequence = model.generate(audio, **options, **kwargs).sequences[0].tolist()
    start = len(kwargs.get("prompt_ids", ())) + 4      # [prompt] sot language task notimestamps
    assert sequence[start - 1] == hf_generation_config().no_timestamps_token_id
    return sequence[start:]


def greedy(audio, n, **options) -> TranscriptionRequest:
    return TranscriptionRequest(audio, max_output_tokens=n, **options)


@pytest.mark.parametrize("name", list(CLIPS))
def test_greedy_ids_equal_hf_generate(engine, checkpoint, name):
    _, model, tokenizer = checkpoint
    audio = CLIPS[name]
    expected = hf_generate(model, audio, language="en")
    result = transcribe(engine, greedy(audio, 24, language="en"))
    assert result.token_ids == expected
    assert len(set(expected)) > 3        # the ids depend on the audio, not one token repeated
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert result.finish_reason == "length" and result.language == "en"


def test_language_detection_and_prompt_equal_hf_generate(engine, checkpoint):
    _, model, tokenizer = checkpoint
    audio = CLIPS["noise-29s"]
    detected = transcribe(engine, greedy(audio, 16))
    full = model.generate(transformers.WhisperFeatureExtractor(feature_size=80)(
        audio, sampling_rate=SR, return_tensors="pt").input_features, task="transcribe", max_new_tokens=16,
        return_dict_in_generate=True, force_unique_generate_call=True).sequences[0].tolist()
    assert detected.token_ids == full[4:]
    language = next(k.strip("<|>") for k, v in hf_generation_config().lang_to_id.items() if v == full[1])
    assert detected.language == language
    text = "the river ran past the old mill"
    prompt_ids = torch.tensor(tokenizer.encode("<|startofprev|>" + " " + text, add_special_tokens=False))
    prompted = transcribe(engine, greedy(CLIPS["chirp-11s"], 16, language="de", prompt=text))
    assert prompted.token_ids == hf_generate(model, CLIPS["chirp-11s"], max_new_tokens=16, language="de",
                                             prompt_ids=prompt_ids)


# ---------------------------------------------------------------- the budget contract


def stream_ids(engine, request):
    chunks = list(engine.submit(request))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


@pytest.mark.parametrize("n", [1, 2, 3, 64])
def test_exactly_n_tokens_without_eos(engine, checkpoint, n):
    _, model, _ = checkpoint
    audio = CLIPS["chirp-11s"]
    before = dict(engine.stats.walk_counts)
    result = transcribe(engine, greedy(audio, n, language="en"))
    assert result.token_ids == hf_generate(model, audio, language="en", max_new_tokens=n)
    assert len(result.token_ids) == result.usage.output_tokens == n and result.finish_reason == "length"
    ids, text, final = stream_ids(engine, greedy(audio, n, language="en"))
    assert (ids, text) == (result.token_ids, result.text) and final.usage.output_tokens == n
    decodes = engine.stats.walk_counts.get("decode", 0) - before.get("decode", 0)
    assert engine.stats.walk_counts.get("prefill", 0) - before.get("prefill", 0) == 2
    assert decodes == (0 if n == 1 else 2)   # N = 1 ends at its prefill: no decode walk at all


@pytest.fixture(scope="module")
def eos_engine(engine, checkpoint):
    """The same model with EOS = a token greedy decoding emits third (first at index 2)."""
    free = transcribe(engine, greedy(CLIPS["chirp-11s"], 24, language="en")).token_ids
    index = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset({free[index]}))
    with Engine(engine.args, loaded=loaded) as with_eos:
        yield with_eos, free, index


@pytest.mark.parametrize("n", [1, 2, 3, 64])
def test_exactly_n_tokens_or_the_eos(eos_engine, checkpoint, n):
    engine, free, index = eos_engine
    _, model, tokenizer = checkpoint
    audio = CLIPS["chirp-11s"]
    eos = free[index]
    result = transcribe(engine, greedy(audio, n, language="en"))
    assert result.token_ids == free[: min(n, index + 1)]             # ends at the EOS, EOS included
    assert result.finish_reason == ("stop" if n > index else "length")
    assert result.usage.output_tokens == len(result.token_ids)
    if n == 64:
        assert result.token_ids == hf_generate(model, audio, eos=eos, language="en", max_new_tokens=64)
    assert result.text == tokenizer.decode(free[: min(n, index)], skip_special_tokens=True).strip()
    ids, text, final = stream_ids(engine, greedy(audio, n, language="en"))
    assert (ids, text, final.finish_reason) == (result.token_ids, result.text, result.finish_reason)


@pytest.mark.slow
def test_long_audio_windows_in_order_joined_by_a_space(eos_engine, checkpoint):
    engine, free, index = eos_engine
    _, model, tokenizer = checkpoint
    eos = free[index]
    audio = np.concatenate([clip("noise", 30, seed=3), clip("chirp", 30, seed=1), clip("sine", 5, seed=2)])
    frames = features(audio)
    windows = []
    for w in range(3):   # HF on each window alone; a window without EOS runs to the context limit
        ids = hf_generate(model, window_of(frames, 3000 * w), eos=eos, language="en", max_new_tokens=MAX_TARGET - 4)
        windows.append(ids[:-1] if ids and ids[-1] == eos else ids)
    expected = [t for ids in windows for t in ids] + [eos]   # the last window's EOS: natural or forced
    result = transcribe(engine, TranscriptionRequest(audio, language="en"))
    assert result.token_ids == expected and result.finish_reason == "stop"
    texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in windows]
    assert result.text == " ".join(t for t in texts if t)
    assert [s.window for s in result.segments] == [w for w in range(3) if windows[w]]
    assert result.usage.windows == 3 and result.usage.audio_seconds == 65.0
    ids, text, _ = stream_ids(engine, TranscriptionRequest(audio, language="en"))
    assert (ids, text) == (result.token_ids, result.text)
    # the budget counts across windows
    n = len(windows[0]) + 2
    cut = transcribe(engine, greedy(audio, n, language="en"))
    assert cut.token_ids == expected[:n] and cut.finish_reason == "length"


def test_windows_are_walks_chosen_by_the_plan(eos_engine):
    """Each window of a 65 s clip is its own encode, prefill and decode walks, chosen by the
    plan; the `end` walk emits the last window's EOS. A budget that runs out in window 1
    starts no window 2."""
    engine, _, _ = eos_engine
    audio = np.concatenate([clip("noise", 30, seed=3), clip("chirp", 30, seed=1), clip("sine", 5, seed=2)])

    def walks_of(request):
        before = dict(engine.stats.walk_counts)
        result = transcribe(engine, request)
        after = engine.stats.walk_counts
        return result, {name: after.get(name, 0) - before.get(name, 0)
                        for name in ("encode", "prefill", "decode", "end")}

    result, counts = walks_of(TranscriptionRequest(audio, language="en"))
    assert result.usage.windows == 3 and result.finish_reason == "stop"
    assert counts["encode"] == counts["prefill"] == 3 and counts["end"] == 1 and counts["decode"] <= 3
    first_window = [t for s in result.segments if s.window == 0 for t in s.token_ids]
    cut, counts = walks_of(greedy(audio, len(first_window) + 1, language="en"))
    assert cut.token_ids == result.token_ids[: len(first_window) + 1] and cut.finish_reason == "length"
    assert counts["encode"] == counts["prefill"] == 2 and counts["end"] == 0


# ---------------------------------------------------------------- batching and resources


@pytest.mark.slow
def test_16_concurrent_transcriptions_equal_each_alone(engine):
    kinds = ["sine", "chirp", "noise"]
    requests = [greedy(clip(kinds[i % 3], 2 + 3 * i, seed=i), 12, language=None if i % 4 == 0 else "en")
                for i in range(16)]
    alone = [transcribe(engine, r).token_ids for r in requests]
    batches_before = engine.stats.node_batches.get("encoder", 0)
    streams = [engine.submit(r) for r in requests]
    together = [[t for c in s for t in c.token_ids] for s in streams]
    assert together == alone
    assert engine.stats.node_batches.get("encoder", 0) - batches_before < 16     # encoder batches were shared


@pytest.mark.slow
def test_preemption_under_a_tiny_kv_cache_keeps_outputs(engine):
    requests = [greedy(clip("chirp", 4 + i, seed=i), 60, language="en") for i in range(6)]
    expected = [transcribe(engine, r).token_ids for r in requests]
    tight_args = dataclasses.replace(engine.args, kv_cache_tokens=MAX_TARGET + 32, page_size=8)
    with Engine(tight_args) as tight:
        streams = [tight.submit(r) for r in requests]
        assert [[t for c in s for t in c.token_ids] for s in streams] == expected
        assert tight.stats.num_preemptions > 0
        model = tight.model
        assert model.cache.allocator.num_free == model.cache.allocator.num_pages
        assert model.cross.num_free == model.cross.shape.num_slots


def test_cancel_frees_pages_and_cross_attention_slots():
    with Engine(EngineArgs("tiny-whisper", max_num_seqs=4)) as engine:
        model = engine.model
        audio = clip("noise", 70)
        streams = [engine.submit(TranscriptionRequest(audio, language="en")) for _ in range(6)]
        iterator = iter(streams[0])
        first = [next(iterator)]                  # it is decoding now; wait for the other three
        deadline = time.monotonic() + 10
        while model.cross.num_free and time.monotonic() < deadline:
            time.sleep(0.01)
        assert model.cross.num_free == 0 and model.cache.allocator.num_free < model.cache.allocator.num_pages
        for stream in streams:
            stream.abort()
        # every stream was cut short: its final chunk says abort, and it got fewer tokens than
        # its budget (no max_output_tokens: every window's decoder context)
        prompt = model.generation.forced_prompt("en", "transcribe")
        budget_per_window = model.config.max_target_positions - len(prompt)
        for chunks in [first + list(iterator)] + [list(stream) for stream in streams[1:]]:
            final, received = chunks[-1], sum(len(chunk.token_ids) for chunk in chunks)
            assert final.finished and final.finish_reason == "abort"
            assert received == final.usage.output_tokens < final.usage.windows * budget_per_window
        deadline = time.monotonic() + 10
        while (engine.num_in_flight or engine.stats.num_running) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert model.cache.allocator.num_free == model.cache.allocator.num_pages
        assert model.cross.num_free == model.cross.shape.num_slots == 4
        assert not model.executors["decoder"].streams


def test_bad_transcription_requests(engine):
    audio = CLIPS["sine-3s"]
    for request, message in [
        (TranscriptionRequest(b""), "empty"),
        (TranscriptionRequest(b"RIFF....WAVEfmt garbage"), "could not decode"),
        (TranscriptionRequest(np.zeros(0, np.float32)), "no samples"),
        (TranscriptionRequest(audio, language="klingon"), "unsupported language"),
        (TranscriptionRequest(audio, max_output_tokens=MAX_TARGET), "exceeds what 1 window"),
        (TranscriptionRequest(audio, prompt="<|endoftext|>"), "special tokens"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.submit(request)
    for kwargs, message in [({"task": "dance"}, "task"), ({"max_output_tokens": 0}, "max_output_tokens"),
                            ({"temperature": -1.0}, "temperature")]:
        with pytest.raises(ValueError, match=message):
            TranscriptionRequest(audio, **kwargs)
    with Engine(EngineArgs("tiny-qwen3")) as text_engine:
        with pytest.raises(ValueError, match="does not transcribe"):
            text_engine.submit(TranscriptionRequest(audio))


def test_sampling_is_seeded_and_batch_invariant(engine):
    audio = CLIPS["noise-29s"]
    requests = [greedy(audio, 16, language="en", temperature=1.0, seed=s) for s in (1, 1, 2)]
    alone = [transcribe(engine, r).token_ids for r in requests]
    together = [[t for c in s for t in c.token_ids] for s in [engine.submit(r) for r in requests]]
    assert together == alone and alone[0] == alone[1] and alone[0] != alone[2]


def test_a_folder_without_preprocessor_config_loads(checkpoint, tmp_path):
    folder, _, _ = checkpoint
    copy = tmp_path / "whisper"
    shutil.copytree(folder, copy)
    (copy / "preprocessor_config.json").unlink()    # optional: the default extractor at the config's bins
    with Engine(EngineArgs(str(copy), max_num_seqs=2)) as engine:
        assert transcribe(engine, greedy(CLIPS["sine-3s"], 5, language="en")).usage.output_tokens == 5


def test_english_only_checkpoint_equals_hf_generate(checkpoint, tmp_path):
    folder, model, _ = checkpoint
    copy = tmp_path / "whisper-en"
    shutil.copytree(folder, copy)
    generation = hf_generation_config().to_dict()
    for key in ("lang_to_id", "task_to_id"):
        generation.pop(key)
    generation.update(is_multilingual=False, forced_decoder_ids=[[1, generation["no_timestamps_token_id"]]])
    (copy / "generation_config.json").write_text(json.dumps(generation))
    english = transformers.GenerationConfig.from_pretrained(copy)
    audio = CLIPS["chirp-11s"]
    features = transformers.WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=SR, return_tensors="pt")
    expected = model.generate(features.input_features, generation_config=english, max_new_tokens=12,
                              return_dict_in_generate=True, force_unique_generate_call=True).sequences[0].tolist()
    assert expected[:2] == [english.decoder_start_token_id, english.no_timestamps_token_id]
    with Engine(EngineArgs(str(copy), max_num_seqs=2)) as engine:
        result = transcribe(engine, greedy(audio, 12))
        assert result.token_ids == expected[2:] and result.language == "en"
        assert transcribe(engine, greedy(audio, 12, language="english")).token_ids == expected[2:]
        for request, message in [(greedy(audio, 12, language="de"), "English-only"),
                                 (greedy(audio, 12, task="translate"), "cannot translate")]:
            with pytest.raises(ValueError, match=message):
                engine.submit(request)


@pytest.mark.slow
def test_decode_graph_path_equals_eager_path(monkeypatch):
    """The decoder's decode-graph path (eager on a CPU, the same buffers and cross-attention
    slots a captured graph reads; the prompts' passes through the prefill graphs' buffers)
    gives the eager path's ids, with language detection (its [sot] step in a graph too),
    windows of long audio, timestamp rules (half the streams) and 8 streams at once."""
    from omniwalk.engine.cuda_graphs import DecodeGraphs
    from omniwalk.engine.prefill_graphs import PrefillGraphs
    from omniwalk.loading import load_model
    from omniwalk.models.whisper.encoder_graphs import EncoderGraphs
    from omniwalk.models.whisper.executors import DecoderStep
    from omniwalk.models.whisper.loading import WHISPER_LOADER

    # the timestamp streams end early (10 ids): the rest then decode without their rules'
    # mask, two steps ahead
    requests = [greedy(clip(["sine", "chirp", "noise"][i % 3], 3 + 5 * i, seed=i), 10 if i % 2 else 30,
                       language=None if i % 3 == 0 else "en", timestamp_granularities=("segment",) * (i % 2))
                for i in range(8)]
    replays = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, **kw: replays.append(list(kw["positions"])) or run(self, **kw))
    encodes = []
    encode = EncoderGraphs.run
    monkeypatch.setattr(EncoderGraphs, "run", lambda self, features: encodes.append(len(features)) or encode(self, features))
    outputs = {}
    for graphs in (False, True):
        args = EngineArgs("tiny-whisper", device="cpu", dtype="float32", max_num_seqs=9, kv_cache_tokens=16384)
        loaded = load_model(args)
        decoder = loaded.served.executors["decoder"]
        if graphs:
            decoder.decode_graphs = DecodeGraphs(DecoderStep(decoder.model), decoder.cache, 8,
                                                 -(-loaded.max_model_len // args.page_size), decoder.cross)
            decoder.prefill_graphs = PrefillGraphs(DecoderStep(decoder.model), decoder.decode_graphs,
                                                   max_sequences=WHISPER_LOADER.prefill_graph_sequences)
            encoder = loaded.served.executors["encoder"]   # and the encoder's graphs' buffers (3 windows a pass)
            encoder.graphs, encoder.max_windows = EncoderGraphs(encoder.encoder, 3), 3
        with Engine(args, loaded=loaded) as engine:
            streams = [engine.submit(r) for r in requests]
            outputs[graphs] = [[t for c in s for t in c.token_ids] for s in streams]
    assert outputs[True] == outputs[False]
    assert sum(len(ids) for ids in outputs[True]) > 80
    assert len(replays) > 20 and max(map(len, replays)) > 1   # batched decode steps went through the graphs
    assert any(0 in positions for positions in replays)        # and language detection ([sot] at position 0)
    assert decoder.prefill_graphs.replays > 0                  # windows' prompts through the prefill graphs
    assert encodes and max(encodes) > 1                 # so did batched windows
    # the shared executor's look-ahead step took decode steps (whether a step also samples
    # through the sampling graphs depends on which streams share it, so on arrival timing:
    # tests/engine/test_lookahead.py checks those)
    assert decoder.lookahead_used > 0
    assert decoder.lookahead_early > 0   # and steps launched two ahead (the cross slots stay put)


def test_phase_changes_take_pages_through_check_act(eos_engine, monkeypatch):
    """Language detection and a window's EOS restart the decoder's sequence: its pages go
    back and the new prompt's come out of the runtime's `can_reserve` / `reserve`, never
    from inside `run` (on a CPU engine no look-ahead step reserves either)."""
    from omniwalk.models.whisper.executors import TranscriptState

    engine, _, _ = eos_engine
    decoder = engine.model.executors["decoder"]
    cache = decoder.cache
    running, inside_run, restarts = [False], [], []
    run, restart = decoder.run, TranscriptState.restart

    def spy_run(calls):
        running[0] = True
        try:
            return run(calls)
        finally:
            running[0] = False

    for name in ("free", "reserve"):
        def spy(*args, _original=getattr(cache, name), _name=name):
            if running[0]:
                inside_run.append(_name)
            return _original(*args)
        monkeypatch.setattr(cache, name, spy)
    monkeypatch.setattr(decoder, "run", spy_run)
    monkeypatch.setattr(TranscriptState, "restart", lambda state, ids: restarts.append(ids) or restart(state, ids))
    audio = np.concatenate([clip("noise", 30, seed=3), clip("chirp", 30, seed=1), clip("sine", 5, seed=2)])
    result = transcribe(engine, TranscriptionRequest(audio))       # the language detected, then 3 windows
    assert result.usage.windows == 3 and result.language is not None
    assert len(restarts) == 3 and not inside_run
    assert cache.allocator.num_free == cache.allocator.num_pages


@pytest.mark.slow
def test_startup_warmup_transcribes_noise_and_changes_no_output(checkpoint, record_batch_sizes):
    """Whisper's warm-up requests (eight seconds of noise: the encoder, language detection,
    decode steps) leave the engine as clean as one that did not warm up."""
    from omniwalk.models.whisper.executors import EncoderExecutor
    folder, _, _ = checkpoint
    encoded, ids = record_batch_sizes(EncoderExecutor), {}
    for warmup in (False, True):
        encoded.clear()
        with Engine(EngineArgs(str(folder), dtype="float32", device="cpu", max_num_seqs=16,
                               startup_warmup=warmup)) as engine:
            assert sum(encoded) == (8 if warmup else 0)
            cache = engine.model.cache
            assert not engine.runtime.running and cache.allocator.num_free == cache.allocator.num_pages
            ids[warmup] = transcribe(engine, greedy(CLIPS["sine-3s"], 12)).token_ids
    assert ids[True] == ids[False] and len(ids[True]) > 0


SHAPES = {   # the Whisper sizes' shape families, tiny: what differs between them
    "turbo": dict(encoder_layers=3, decoder_layers=1, num_mel_bins=128),   # large-v3-turbo: 32/4 layers, 128 mels
    "small": dict(encoder_layers=1, decoder_layers=3, num_mel_bins=80),    # tiny..medium: 80 mels
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_families_equal_hf_generate(tmp_path, name):
    """Decoder layers != encoder layers, 80 or 128 mel bins: greedy ids equal transformers'
    (on its features of the same mel bins); the language detected as it detects it."""
    shape = SHAPES[name]
    model = save_tiny_whisper(tmp_path, 48, **shape)
    audio = clip("chirp", 7, seed=4)
    frames = features(audio, shape["num_mel_bins"])
    expected = hf_generate(model, frames, max_new_tokens=12)     # the language detected
    with Engine(EngineArgs(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=2)) as engine:
        assert engine.model.config.decoder_layers == shape["decoder_layers"]
        assert transcribe(engine, greedy(audio, 12)).token_ids == expected


def test_fused_self_attention_projections_keep_parameters_and_outputs():
    """q, k, v fused into one GEMM: the same parameter names and values (they view the fused
    weight), the same encoder states, and a weight loaded afterwards lands in the fused one."""
    from omniwalk.models.loader import init_random_weights
    from omniwalk.models.whisper.config import tiny_config
    from omniwalk.models.whisper.encoder_graphs import EncoderGraphs
    from omniwalk.models.whisper.modeling import WhisperForConditionalGeneration

    config = tiny_config(64)
    net = WhisperForConditionalGeneration(config).eval()
    init_random_weights(net, seed=3)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.02)   # zero biases would hide a bias in the wrong rows
    before = {name: t.clone() for name, t in net.state_dict().items()}
    features = torch.randn(3, config.num_mel_bins, config.num_frames)
    with torch.inference_mode():
        expected = net.encoder(features)
    net.fuse_projections()
    after = net.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    attention = net.encoder.layers[0].self_attn
    with torch.inference_mode():
        torch.testing.assert_close(net.encoder(features), expected)
        # the encoder graphs' path on a CPU: rows past n are stale, results for n only
        graphs = EncoderGraphs(net.encoder, 4)
        graphs.run(torch.randn(4, config.num_mel_bins, config.num_frames))
        torch.testing.assert_close(graphs.run(features[:2]), expected[:2])
    with torch.no_grad():
        attention.v_proj.weight.fill_(0.5)
    assert torch.all(attention.qkv[0][2 * config.d_model :] == 0.5)
