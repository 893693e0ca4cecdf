"""Qwen3-Omni's speech out against transformers (`Qwen3OmniMoeForConditionalGeneration.generate`
with `return_audio=True`) on a tiny random full checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3OmniMoeForConditionalGeneration  # noqa: E402

from omniwalk.models.qwen3_omni.talker_config import TalkerConfig  # noqa: E402
from omniwalk.models.qwen3_omni.talker_prompt import NO_CODEC, talker_prompt, trailing_id  # noqa: E402
from qwen3_omni_speech_config import SPEAKERS, full_hf_config  # noqa: E402

# system turn, user turn, assistant turn opened: the Talker reads the user turn only
PROMPT = [280, 284, 10, 11, 281, 12, 280, 282, 13, 14, 15, 281, 12, 280, 283, 12]


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(full_hf_config()).eval()
    # transformers' init leaves the Talker's fused expert weights as torch.empty made them:
    # whatever the allocator held, NaN at times (in CI's order every frame then decoded as
    # code 0, and the Triton interpreter warned of all-NaN slices). Drawn here instead.
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("talker.") and ".experts." in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return model


def talker_config(model) -> TalkerConfig:
    return TalkerConfig.from_hf(model.config.to_dict())


def hf_speak(model, prompt, eos: int, max_new_tokens: int = 8, talker_tokens: int = 12,
             repetition_penalty: float = 1.0):
    """transformers' generate: (answer ids, wav, what it handed its Talker)."""
    captured = {}
    talker_generate = model.talker.generate

    def spy(**kwargs):
        captured.update(kwargs)
        return talker_generate(**kwargs)

    model.talker.generate = spy
    try:
        sequences, wav = model.generate(input_ids=torch.tensor([prompt]), thinker_max_new_tokens=max_new_tokens,
                                        thinker_eos_token_id=eos, talker_max_new_tokens=talker_tokens,
                                        talker_do_sample=False, talker_repetition_penalty=repetition_penalty,
                                        speaker="Ethan")
    finally:
        model.talker.generate = talker_generate
    return sequences[0, len(prompt):].tolist(), wav, captured


@pytest.fixture(scope="module")
def hf_spoken(hf_model):
    """An answer that ends on its stop token (the first run's 4th token made the EOS of the
    second), its 39 greedy frames' audio, and the Talker's inputs."""
    answer, _, _ = hf_speak(hf_model, PROMPT, eos=281, talker_tokens=2)
    eos = answer[3]
    answer, wav, captured = hf_speak(hf_model, PROMPT, eos=eos, talker_tokens=40)
    assert answer[-1] == eos and eos not in answer[:-1]
    return answer, wav, captured


def text_part(model, ids):
    return model.talker.text_projection(model.thinker.get_input_embeddings()(torch.tensor(ids)))


def test_talker_prompt_is_what_transformers_feeds_its_talker(hf_model, hf_spoken):
    answer, _, captured = hf_spoken
    config = talker_config(hf_model)
    tokens = config.prompt
    prompt = talker_prompt(PROMPT, answer[:-1], SPEAKERS["ethan"], config)   # the client's answer: no EOS
    with torch.no_grad():
        rows = text_part(hf_model, list(prompt.text_ids))
        codec = torch.tensor([max(c, 0) for c in prompt.codec_ids])
        has_codec = torch.tensor([c != NO_CODEC for c in prompt.codec_ids])[:, None]
        rows = rows + hf_model.talker.get_input_embeddings()(codec) * has_codec
        torch.testing.assert_close(rows, captured["inputs_embeds"][0])
        steps = range(len(prompt.trailing_ids) + 1)   # the answer's text, then tts_eos
        trailing = text_part(hf_model, [trailing_id(prompt.trailing_ids, j, tokens) for j in steps])
        torch.testing.assert_close(trailing, captured["trailing_text_hidden"][0])
        torch.testing.assert_close(text_part(hf_model, [trailing_id(prompt.trailing_ids, 99, tokens)]),
                                   captured["tts_pad_embed"][0])
    assert prompt.media_rows == ()


# ----------------------------------------------------------------------------- served end to end

@pytest.fixture(scope="module")
def speaking_engine(hf_model, tmp_path_factory):
    from omniwalk import Engine, EngineArgs

    folder = tmp_path_factory.mktemp("qwen3-omni-full")
    hf_model.save_pretrained(folder)
    write_preprocessing(folder)
    with Engine(EngineArgs(str(folder), dtype="float32", device="cpu", max_model_len=256)) as engine:
        yield engine


def write_preprocessing(folder) -> None:
    """The image and audio preprocessing of the tiny Thinker's media tests."""
    import json

    from test_qwen3_omni import MELS, PREPROCESSING

    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSING | {"feature_size": MELS}))


def speak(engine, prompt, max_tokens, max_frames, stop_token_ids=(), **kw):
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, collect_generation
    from omniwalk.engine.sampler import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    request = GenerationRequest(prompt_token_ids=prompt, max_tokens=max_tokens, stop_token_ids=list(stop_token_ids),
                                sampling=greedy, speech=SpeechOutput("Ethan", max_frames, sampling=greedy), **kw)
    return collect_generation(engine.submit(request))


def test_speech_equals_transformers(hf_spoken, speaking_engine):
    """Greedy text and audio of transformers' generate(return_audio=True) (Talker greedy, no
    repetition penalty), for an answer that ends on its stop token."""
    answer, wav, _ = hf_spoken
    eos = answer[-1]
    result = speak(speaking_engine, PROMPT, 8, 39, stop_token_ids=[eos])
    assert result.token_ids == answer
    ours = np.frombuffer(result.audio, "<i2").astype(np.float32) / 32767
    expected = wav.reshape(-1).numpy()
    assert ours.shape == expected.shape and expected.size > 0
    assert np.abs(ours - expected).max() < 2e-4


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`")   # as ours: new codes only
def test_speech_with_a_repetition_penalty_equals_transformers(hf_model, hf_spoken, speaking_engine):
    """The Talker's repetition penalty (greedy, 1.3: the first codes it already chose pushed
    down) as transformers' generate applies it (`talker_repetition_penalty`): the same audio,
    and not the audio without it."""
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, collect_generation
    from omniwalk.engine.sampler import SamplingParams

    answer, plain, _ = hf_spoken
    eos = answer[-1]
    _, wav, _ = hf_speak(hf_model, PROMPT, eos=eos, talker_tokens=40, repetition_penalty=1.3)
    greedy = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    request = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=8, stop_token_ids=[eos], sampling=greedy,
                                speech=SpeechOutput("Ethan", 39, sampling=penalized))
    result = collect_generation(speaking_engine.submit(request))
    assert result.token_ids == answer
    ours = np.frombuffer(result.audio, "<i2").astype(np.float32) / 32767
    expected = wav.reshape(-1).numpy()
    assert ours.shape == expected.shape and expected.size > 0
    assert np.abs(ours - expected).max() < 2e-4
    without = plain.reshape(-1).numpy()
    assert expected.shape != without.shape or np.abs(expected - without).max() > 1e-2   # the penalty mattered


def samples(frames: int) -> int:
    """A stream of F frames: F * U - D samples (Code2Wav's lookahead, as transformers' decode)."""
    from omniwalk.models.qwen3_omni.code2wav import emitted_samples
    from omniwalk.models.qwen3_omni.code2wav_config import Code2WavConfig

    return emitted_samples(Code2WavConfig.from_hf(full_hf_config().to_dict()), frames)


@pytest.mark.parametrize("tokens, frames", [(1, 1), (2, 2), (3, 3), (64, 9), (5, 64)])
def test_budgets_are_exact_streamed_and_not(speaking_engine, tokens, frames):
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput
    from omniwalk.engine.sampler import SamplingParams

    alone = speak(speaking_engine, PROMPT, tokens, frames, ignore_eos=True)
    assert len(alone.token_ids) == tokens and len(alone.audio) == 2 * samples(frames)
    assert alone.usage.audio_frames == frames
    request = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=tokens, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.0),
                                speech=SpeechOutput("ethan", frames, sampling=SamplingParams(temperature=0.0)))
    chunks = list(speaking_engine.submit(request))
    assert [t for c in chunks for t in c.token_ids] == alone.token_ids
    assert b"".join(c.audio for c in chunks) == alone.audio
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"


def test_text_only_on_a_speaking_model_and_mixed_batches(speaking_engine):
    """No audio unless asked; sampled speech in a batch with other requests equals it alone."""
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, collect_generation
    from omniwalk.engine.sampler import SamplingParams

    plain = collect_generation(speaking_engine.submit(GenerationRequest(prompt_token_ids=PROMPT, max_tokens=6,
                                                                        ignore_eos=True)))
    spoken = speak(speaking_engine, PROMPT, 6, 7, ignore_eos=True)
    assert plain.audio == b"" and spoken.token_ids == plain.token_ids
    # 16 requests, text-only and speaking, sampled, in three voices
    voices = ["ethan", "Chelsie", "AIDEN", None]
    mixed = [GenerationRequest(prompt_token_ids=PROMPT[:-3] + [280, 283, 12 + i], max_tokens=3 + i % 5, ignore_eos=True,
                               sampling=SamplingParams(temperature=1.0, seed=i),
                               speech=None if voices[i % 4] is None else
                               SpeechOutput(voices[i % 4], 4 + i % 3, sampling=SamplingParams(temperature=0.9)))
             for i in range(16)]
    alone = [collect_generation(speaking_engine.submit(r)) for r in mixed]
    together = [collect_generation(s) for s in [speaking_engine.submit(r) for r in mixed]]
    assert [(r.token_ids, r.audio) for r in together] == [(r.token_ids, r.audio) for r in alone]
    assert [len(r.audio) for r in alone] == [0 if voices[i % 4] is None else 2 * samples(4 + i % 3)
                                             for i in range(16)]


def test_the_talker_keeps_each_streams_first_codes_on_the_device():
    """The repetition penalty's ids (`TalkerExecutor._seen_codes`): a row per stream made from
    its first codes so far, each new first code added as `_commit` adds it, the row freed
    with the stream; the mask holds exactly each stream's codes."""
    from types import SimpleNamespace

    from omniwalk.engine.sampler import SamplingParams
    from omniwalk.models.qwen3_omni.speech_executors import TalkerExecutor

    vocab = 16
    executor = SimpleNamespace(seen_codes=None, device=torch.device("cpu"), max_batch_size=2)
    histories = {7: [3, 3, 5], 9: [], 11: [1]}
    penalized = SimpleNamespace(sampling=SamplingParams(temperature=1.0, repetition_penalty=1.3))
    plain = SimpleNamespace(sampling=SamplingParams(temperature=1.0))

    def seen(handles):
        calls = [SimpleNamespace(stream=SimpleNamespace(handle=h)) for h in handles]
        sequences = [SimpleNamespace(first_codes=histories[h]) for h in handles]
        mask = TalkerExecutor._seen_codes(executor, calls, sequences, [penalized] * len(handles), vocab)
        return [sorted(torch.nonzero(row).flatten().tolist()) for row in mask]

    assert TalkerExecutor._seen_codes(executor, [], [], [plain], vocab) is None   # no penalty: no mask
    assert seen([7, 9]) == [[3, 5], []]
    for handle, code in ((7, 8), (9, 2), (9, 2)):     # the next frames' first codes, as `_commit` adds them
        histories[handle].append(code)
        executor.seen_codes.append(handle, code)
    assert seen([9, 7, 11]) == [[2], [3, 5, 8], [1]]   # a third stream grows the mask
    executor.seen_codes.free(7)
    histories[7] = [4]                                 # a new stream in the freed row starts clean
    assert seen([7]) == [[4]]


@pytest.mark.parametrize("speech, message", [
    (dict(voice="nobody"), "unknown voice"),
    (dict(voice="ethan", prompt=[5, 6, 7]), "assistant"),
])
def test_bad_speech_requests_fail_alone(speaking_engine, speech, message):
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput

    prompt = speech.pop("prompt", PROMPT)
    with pytest.raises(ValueError, match=message):
        speaking_engine.submit(GenerationRequest(prompt_token_ids=prompt, max_tokens=2, speech=SpeechOutput(**speech)))
    assert speak(speaking_engine, PROMPT, 2, 2, ignore_eos=True).audio   # the engine goes on


def test_the_tiny_model_speaks():
    from omniwalk import Engine, EngineArgs
    from omniwalk.capabilities import Capability
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, collect_generation

    with Engine(EngineArgs("tiny-qwen3-omni", device="cpu", dtype="float32")) as engine:
        frontend = engine.frontend(Capability.TEXT)
        assert frontend.voices == ("aiden", "chelsie", "ethan") and frontend.audio_sample_rate == 24000
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], tokenize=False,
                                                      add_generation_prompt=True)
        result = collect_generation(engine.submit(GenerationRequest(
            prompt=prompt, max_tokens=4, ignore_eos=True, speech=SpeechOutput("Ethan", 6))))
    assert len(result.token_ids) == 4 and len(result.audio) > 0


def test_startup_warmup_speaks_a_full_batch_and_changes_no_output(monkeypatch):
    """A model that speaks warms up spoken answers too (as many as the engine batches, each
    SPEAKING_WARMUP_FRAMES frames); the engine is then as clean as one that did not warm up."""
    from omniwalk import Engine, EngineArgs
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, collect_generation
    from omniwalk.engine.sampler import SamplingParams
    from omniwalk.models.qwen3_omni import frontend
    from omniwalk.models.qwen3_omni.model import TALKER_STREAM

    monkeypatch.setattr(frontend, "SPEAKING_WARMUP_FRAMES", 5)   # chunks of 4 and 1: CI's time
    results = {}
    for warmup in (False, True):
        args = EngineArgs("tiny-qwen3-omni", device="cpu", dtype="float32", max_num_seqs=2, startup_warmup=warmup)
        with Engine(args) as engine:
            if warmup:
                requests = frontend.speaking_warmup(engine.loaded)
                assert len(requests) == 2 and all(r.streams[TALKER_STREAM].max_items == 5 for r in requests)
            executors = engine.model.executors
            assert not executors["talker"].sequences and not executors["thinker"].sequences
            assert not engine.runtime.running and not engine.runtime.walk_counts
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], tokenize=False,
                                                          add_generation_prompt=True)
            greedy = SamplingParams(temperature=0.0, seed=1)
            results[warmup] = collect_generation(engine.submit(GenerationRequest(
                prompt=prompt, max_tokens=4, ignore_eos=True, sampling=greedy, speech=SpeechOutput("Ethan", 6))))
    assert results[True].token_ids == results[False].token_ids and results[True].audio == results[False].audio
    assert len(results[True].audio) > 0


def test_audio_starts_while_the_text_is_written(speaking_engine):
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput
    from omniwalk.engine.sampler import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    chunks = list(speaking_engine.submit(GenerationRequest(prompt_token_ids=PROMPT, max_tokens=16, ignore_eos=True,
                                                          sampling=greedy, speech=SpeechOutput("ethan", 8, greedy))))
    first_audio = next(i for i, c in enumerate(chunks) if c.audio)
    last_text = max(i for i, c in enumerate(chunks) if c.token_ids)
    assert first_audio < last_text
    assert sum(len(c.token_ids) for c in chunks) == 16 and sum(len(c.audio) for c in chunks) == 2 * samples(8)


def test_cancel_mid_speech_frees_every_component(speaking_engine):
    import time

    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput

    executors = speaking_engine.model.executors
    caches = [executors["thinker"].cache, executors["talker"].cache]
    used_before = [cache.allocator.num_used for cache in caches]
    stream = speaking_engine.submit(GenerationRequest(prompt_token_ids=PROMPT, max_tokens=60, ignore_eos=True,
                                                      speech=SpeechOutput("ethan", 200)))
    for chunk in stream:
        if chunk.audio:   # speaking: the Talker and Code2Wav are at work
            break
    assert caches[1].allocator.num_used > used_before[1]
    speaking_engine.abort(stream.request_id)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (executors["talker"].sequences
                                           or caches[1].allocator.num_used > used_before[1]):
        time.sleep(0.05)
    assert not executors["talker"].sequences and not executors["thinker"].sequences
    # what stays is what was there before (the Talker's graphs hold a scratch page, for good)
    assert [cache.allocator.num_used for cache in caches] == used_before


# ----------------------------------------------------------------------------- speaking about media

def user_turn_with(*media):
    """A system turn, then a user turn holding `media` (placeholder ids) and text, then the
    assistant's turn opened: the Talker reads the user turn, its media rows as the
    Thinker's hidden states."""
    from test_qwen3_omni import AUDIO, AUDIO_END, AUDIO_START, IMAGE, VISION_END, VISION_START

    markers = {"image": [VISION_START, IMAGE, VISION_END], "audio": [AUDIO_START, AUDIO, AUDIO_END]}
    user = [13] + [token for kind in media for token in markers[kind]] + [14, 15]
    return [280, 284, 10, 11, 281, 12, 280, 282] + user + [281, 12, 280, 283, 12]


MEDIA_CASES = {"image": ("image",), "audio": ("audio",)}


def media_inputs(kinds):
    from test_qwen3_omni import clip, image

    images = tuple(image(5) for kind in kinds if kind == "image")
    clips = tuple(clip(4) for kind in kinds if kind == "audio")
    return images, clips


def hf_speak_media(model, kinds, talker_tokens: int, max_new_tokens: int = 6):
    """transformers' generate(return_audio=True) on a prompt with media: (answer, wav, the
    Talker's inputs). Its answer ends on its stop token: the 4th token of a first run."""
    from test_qwen3_omni import hf_inputs

    images, clips = media_inputs(kinds)
    input_ids, kwargs = hf_inputs(user_turn_with(*kinds), images, clips)
    captured = {}
    talker_generate = model.talker.generate

    def spy(**kw):
        captured.update(kw)
        return talker_generate(**kw)

    def run(eos, tokens):
        sequences, wav = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                        thinker_max_new_tokens=max_new_tokens, thinker_eos_token_id=eos,
                                        talker_max_new_tokens=tokens, talker_do_sample=False,
                                        talker_repetition_penalty=1.0, speaker="Ethan", **kwargs)
        return sequences[0, input_ids.shape[1]:].tolist(), wav

    model.talker.generate = spy
    try:
        first, _ = run(281, 2)
        eos = first[3]
        answer, wav = run(eos, talker_tokens)
    finally:
        model.talker.generate = talker_generate
    assert answer[-1] == eos and eos not in answer[:-1]
    return answer, wav, captured


@pytest.fixture(scope="module")
def hf_media_spoken(hf_model):
    return {case: hf_speak_media(hf_model, kinds, talker_tokens=24) for case, kinds in MEDIA_CASES.items()}


def speak_media(engine, kinds, max_tokens, max_frames, **kw):
    from omniwalk.capabilities.media import AudioInput, ImageInput

    images, clips = media_inputs(kinds)
    media = tuple(ImageInput(img, f"image {i}") for i, img in enumerate(images))
    media += tuple(AudioInput(c, f"audio {i}") for i, c in enumerate(clips))
    return speak(engine, user_turn_with(*kinds), max_tokens, max_frames, media=media, **kw)


def hf_talker_positions(model, captured) -> torch.Tensor:
    """[3, rows] the rotary positions of transformers' Talker prefill (plain without images)."""
    ids = captured["talker_input_ids"]
    grid = captured.get("image_grid_thw")
    if grid is None:
        return torch.arange(ids.shape[1]).expand(3, -1)
    positions, _ = model.talker.get_rope_index(ids, grid, None, torch.ones_like(ids))
    return positions[:, 0].long()


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_speech_about_media_equals_transformers(hf_model, hf_media_spoken, speaking_engine, case):
    """An image or an audio clip in the user turn: the Talker reads the Thinker's hidden
    states (`accept_hidden_layer`) at its rows; greedy text and audio == transformers'."""
    answer, wav, captured = hf_media_spoken[case]
    eos = answer[-1]
    frames = 23   # the Talker's 24 tokens: 23 frames, then it stops at its budget
    talker = speaking_engine.model.executors["talker"]
    seen = {}
    prompt_rows, forward = talker._prompt_rows, talker.talker.forward

    def spy_rows(prompt, media_hidden):
        seen.setdefault("rows", prompt_rows(prompt, media_hidden))
        seen.setdefault("media_rows", prompt.media_rows)
        return seen["rows"]

    def spy_forward(rows, positions, attention):
        seen.setdefault("positions", positions.clone())   # the prefill's: one pass (no chunk limit here)
        return forward(rows, positions, attention)

    talker._prompt_rows, talker.talker.forward = spy_rows, spy_forward
    try:
        result = speak_media(speaking_engine, MEDIA_CASES[case], 6, frames, stop_token_ids=[eos])
    finally:
        del talker._prompt_rows, talker.talker.forward
    assert result.token_ids == answer
    # the Talker's prefill rows: its media rows are the Thinker's hidden states there, projected
    assert len(seen["media_rows"]) > 0
    torch.testing.assert_close(seen["rows"], captured["inputs_embeds"][0], rtol=1e-5, atol=1e-5)
    # and its rotary positions: (t, h, w) with an image, as transformers' Talker reads them
    positions = seen["positions"] if seen["positions"].dim() == 2 else seen["positions"].expand(3, -1)
    assert positions.tolist() == hf_talker_positions(hf_model, captured).tolist()
    assert (case == "image") == (seen["positions"].dim() == 2)
    ours = np.frombuffer(result.audio, "<i2").astype(np.float32) / 32767
    expected = wav.reshape(-1).numpy()
    assert ours.shape == expected.shape and expected.size > 0
    assert np.abs(ours - expected).max() < 2e-4


@pytest.fixture(scope="module")
def chunked_engine(hf_model, tmp_path_factory):
    """The same checkpoint, prefilling at most 8 tokens a step, no prefix cache."""
    from omniwalk import Engine, EngineArgs

    folder = tmp_path_factory.mktemp("qwen3-omni-full-chunked")
    hf_model.save_pretrained(folder)
    write_preprocessing(folder)
    with Engine(EngineArgs(str(folder), dtype="float32", device="cpu", max_model_len=256, max_num_batched_tokens=8,
                           enable_prefix_caching=False)) as engine:
        yield engine


@pytest.mark.parametrize("case", list(MEDIA_CASES))
def test_speech_about_media_with_chunked_prefill(hf_media_spoken, chunked_engine, case):
    """A prompt prefilled 8 tokens at a time: the hidden states kept chunk by chunk make the
    same text and frames."""
    answer, wav, captured = hf_media_spoken[case]
    thinker = chunked_engine.model.executors["thinker"]
    passes, forward = [], thinker.model.forward

    def spy(input_ids, positions, attention, *extra):
        passes.append((len(input_ids), extra[1].rows.numel() if len(extra) > 1 else 0))
        return forward(input_ids, positions, attention, *extra)

    thinker.model.forward = spy
    try:
        result = speak_media(chunked_engine, MEDIA_CASES[case], 6, 23, stop_token_ids=[answer[-1]])
    finally:
        del thinker.model.forward
    assert result.token_ids == answer
    ours = np.frombuffer(result.audio, "<i2").astype(np.float32) / 32767
    assert ours.shape == wav.reshape(-1).shape and np.abs(ours - wav.reshape(-1).numpy()).max() < 2e-4
    # the media rows were kept by several passes of at most 8 tokens
    captures = [rows for _, rows in passes if rows]
    assert len(captures) > 1 and max(n for n, _ in passes) <= 8
    assert sum(captures) == int((captured["talker_input_ids"][0] == (291 if case == "image" else 290)).sum())


def test_speech_about_media_after_a_cached_prefix(speaking_engine, chunked_engine):
    """Pages cached by another request: the speaking one reuses those before the first
    media row only (it must compute the hidden states there), and speaks as without a cache."""
    kinds = MEDIA_CASES["image"]
    long_system = [280, 284] + list(range(20, 50)) + [281, 12]   # two full pages before the user turn
    prompt = long_system + user_turn_with(*kinds)[5:]
    images, _ = media_inputs(kinds)
    from omniwalk.capabilities.media import ImageInput
    from omniwalk.capabilities.text import GenerationRequest, collect_generation

    media = (ImageInput(images[0], "image 0"),)
    cache = speaking_engine.loaded.served.cache
    collect_generation(speaking_engine.submit(GenerationRequest(prompt_token_ids=prompt, max_tokens=2, media=media)))
    hits = cache.num_cached_tokens_hit
    cached = speak(speaking_engine, prompt, 5, 12, ignore_eos=True, media=media)
    reused = cache.num_cached_tokens_hit - hits
    first_media = prompt.index(291)
    assert 0 < reused <= first_media and reused == first_media // 16 * 16
    fresh = speak(chunked_engine, prompt, 5, 12, ignore_eos=True, media=media)
    assert (cached.token_ids, cached.audio) == (fresh.token_ids, fresh.audio) and cached.audio
    # text only, the same prompt: every cached page (the image's too)
    hits = cache.num_cached_tokens_hit
    collect_generation(speaking_engine.submit(GenerationRequest(prompt_token_ids=prompt, max_tokens=2, media=media)))
    assert cache.num_cached_tokens_hit - hits > first_media


def test_kept_hidden_states_survive_a_recompute():
    """Rows are written chunk by chunk; a recompute after preemption leaves the written ones;
    the holder crosses to the engine process empty."""
    import pickle

    from omniwalk.models.qwen3_omni.executors import MediaHidden

    kept = MediaHidden((3, 4, 9, 10, 11))
    kept.write(0, 2, torch.full((2, 4), 1.0))
    kept.write(0, 3, torch.full((3, 4), 2.0))   # preempted, recomputed from the start: rows 0, 1 stay
    assert not kept.complete
    kept.write(2, 5, torch.full((3, 4), 3.0))
    assert kept.complete and kept.states[:, 0].tolist() == [1.0, 1.0, 2.0, 3.0, 3.0]
    again = pickle.loads(pickle.dumps(kept))
    assert again.positions == kept.positions and again.states is None and again.written == 0
    with pytest.raises(ValueError):
        MediaHidden((4, 3))


def test_speech_about_media_under_preemption(hf_model, chunked_engine, tmp_path, monkeypatch):
    """Four speaking requests about images in a KV cache too small for them: prefills are
    preempted after keeping some media rows and recomputed; each speaks as it does alone."""
    from omniwalk import Engine, EngineArgs
    from omniwalk.capabilities.media import ImageInput
    from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, collect_generation
    from omniwalk.engine.sampler import SamplingParams
    from omniwalk.models.qwen3_omni.executors import ThinkerExecutor
    from test_qwen3_omni import IMAGE, VISION_END, VISION_START, image

    greedy = SamplingParams(temperature=0.0)
    # the image first, then a long text: a prefill keeps the image's rows, then is preempted
    prompt = [280, 282, VISION_START, IMAGE, VISION_END] + list(range(20, 80)) + [281, 12, 280, 283, 12]
    requests = [GenerationRequest(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, sampling=greedy,
                                  media=(ImageInput(image(20 + i), "image 0"),),
                                  speech=SpeechOutput("ethan", 5, sampling=greedy)) for i in range(4)]
    alone = [collect_generation(chunked_engine.submit(r)) for r in requests]
    hf_model.save_pretrained(tmp_path)
    write_preprocessing(tmp_path)
    mid_prefill, preempt = [], ThinkerExecutor.preempt

    def spy(self, stream):
        sequence = self.sequences[stream.handle]
        if sequence.media is not None and 3 < sequence.num_computed < sequence.prompt_len:
            mid_prefill.append(sequence.num_computed)   # past the image's rows, before the prompt's end
        return preempt(self, stream)

    monkeypatch.setattr(ThinkerExecutor, "preempt", spy)
    args = EngineArgs(str(tmp_path), dtype="float32", device="cpu", max_model_len=256, kv_cache_tokens=128,
                      page_size=8, max_num_batched_tokens=8, enable_prefix_caching=False)
    with Engine(args) as tight:
        together = [collect_generation(s) for s in [tight.submit(r) for r in requests]]
        assert tight.stats.num_preemptions > 0
    assert mid_prefill
    assert [(r.token_ids, r.audio) for r in together] == [(r.token_ids, r.audio) for r in alone]
    assert all(r.audio for r in alone)


def test_a_talker_sequence_reads_its_rows_across_prompt_and_steps():
    """A Talker sequence keeps its prompt's rows and one row per step apart (no tensor grown
    each step): any range reads back as the rows in order; a step whose row `run` has yet
    to build counts already."""
    from omniwalk.models.qwen3_omni.speech_executors import TalkerSequence

    rows = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
    sequence = TalkerSequence(prompt=None, prompt_rows=rows[:4], trailing=[], step_rows=list(rows[4:].split(1)))
    assert (sequence.step, sequence.num_rows) == (3, 7)
    for start in range(7):
        for count in range(1, 8 - start):
            assert torch.equal(sequence.rows(start, count), rows[start : start + count])
    sequence.step_text = 12
    assert (sequence.step, sequence.num_rows) == (4, 8)
