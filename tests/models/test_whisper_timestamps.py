"""Whisper's windows. With timestamp tokens (timestamp_granularities=("segment",)): greedy
ids and segments equal to transformers' `generate(return_timestamps=True,
return_segments=True)`, short-form and long-form (windows that start where the last
timestamp says), with a prompt, a detected language and the translate task; the window
split on its own. The temperature fallback: transformers' checks, and a window decoded
again at each temperature of the schedule while it fails them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniwalk import Engine, EngineArgs
from omniwalk.capabilities.transcription import TranscriptionRequest, transcribe
from omniwalk.models.whisper.alignment import dynamic_time_warping
from omniwalk.models.whisper.fallback import compression_ratio, window_fails
from omniwalk.models.whisper.timestamps import TimedSegment, split_window

transformers = pytest.importorskip("transformers")

from whisper_checkpoints import clip, features, save_tiny_whisper  # noqa: E402

MAX_TARGET = 40          # short windows: a few timestamps each, and contexts that fill up
BEGIN = 512              # <|0.00|> of tiny-whisper's vocabulary
LONG = np.concatenate([clip("noise", 30, seed=3), clip("chirp", 30, seed=1), clip("sine", 5, seed=2)])
LONG_2 = np.concatenate([clip("sine", 25, seed=1), clip("chirp", 20, seed=2), clip("noise", 20, seed=4)])
PROMPT = "the river ran past the old mill"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """EOS's row a copy of a text token's (x1.1): windows end on EOS after a timestamp, on
    EOS alone, or run to their 40 positions; both kinds of seek follow."""
    folder = tmp_path_factory.mktemp("tiny-whisper-timestamps")
    model = save_tiny_whisper(folder, MAX_TARGET, eos_like=(251, 1.1))
    return folder, model, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def engine(checkpoint):
    folder, _, _ = checkpoint
    with Engine(EngineArgs(str(folder), dtype="float32", device="cpu", max_num_seqs=8)) as engine:
        yield engine


def hf_segments(model, audio, **kwargs) -> tuple[list[tuple[float, float, list[int]]], list[int]]:
    """transformers' segments (start, end, tokens) and its sequence of a transcription with timestamps."""
    seeks = []
    out = model.generate(features(audio), return_timestamps=True, return_segments=True,
                         monitor_progress=lambda progress: seeks.append(int(progress[0, 0])), **kwargs)
    segments = [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]
    sequence = [t for s in segments for t in s[2]]
    assert out["sequences"][0].tolist()[: len(sequence)] == sequence
    return segments, seeks


CASES = {   # name: (audio, our request's options, HF's generate options); seeks as HF's windows started
    "short": (clip("sine", 3), {"language": "en"}, {"language": "en", "task": "transcribe"}),    # 0, 558, 1116
    "long-detected": (LONG, {}, {"task": "transcribe"}),                                       # 0, 2610, 5554
    "long-prompt": (LONG_2, {"prompt": PROMPT}, {"task": "transcribe"}),                       # 0, 2944, 5944
    "translate": (clip("chirp", 11), {"language": "de", "task": "translate"},                  # 0, 2870
                  {"language": "de", "task": "translate"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_segments_equal_hf_generate_with_timestamps(engine, checkpoint, name):
    _, model, tokenizer = checkpoint
    audio, ours, theirs = CASES[name]
    if "prompt" in ours:
        theirs = dict(theirs, prompt_ids=torch.tensor(tokenizer.encode("<|startofprev|> " + PROMPT,
                                                                       add_special_tokens=False)))
    expected, seeks = hf_segments(model, audio, **theirs)
    result = transcribe(engine, TranscriptionRequest(audio, timestamp_granularities=("segment",), **ours))
    got = [(s.start, s.end, s.token_ids) for s in result.segments]
    assert got == expected                      # times to the bit: the same float64 arithmetic
    assert {s.seek for s in result.segments} <= set(seeks)    # HF's windows: `monitor_progress` saw each start
    assert len(seeks) > 1 and len(expected) >= 3    # more than one window, several segments
    assert result.usage.windows == len(seeks) and result.finish_reason == "stop"
    texts = [tokenizer.decode([t for t in tokens if t < BEGIN], skip_special_tokens=True).strip()
             for _, _, tokens in expected]
    assert result.text == " ".join(t for t in texts if t)
    # every sampled token is in the stream (a window's tokens after its last segment too)
    assert result.token_ids[-1] == model.generation_config.eos_token_id
    assert len(result.token_ids) >= sum(len(tokens) for _, _, tokens in expected)


def test_detected_language_and_windows_of_long_audio(engine, checkpoint):
    """The long case detects a language (as HF does from the first window) and its windows
    start where transformers' did: a seek past a window's start, not every 30 s."""
    _, model, _ = checkpoint
    language = model.detect_language(features(LONG)).item()
    codes = {v: k.strip("<|>") for k, v in model.generation_config.lang_to_id.items()}
    result = transcribe(engine, TranscriptionRequest(LONG, timestamp_granularities=("segment",), max_output_tokens=3))
    assert result.language == codes[language] and result.finish_reason == "length"
    assert len(result.token_ids) == 3


def test_streamed_text_equals_the_segments(engine):
    request = TranscriptionRequest(LONG, language="en", timestamp_granularities=("segment",))
    chunks = list(engine.submit(request))
    result = transcribe(engine, request)
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert chunks[-1].segments == result.segments


def test_split_window_cases():
    """transformers' `_retrieve_segment`, case by case (B: <|0.00|>, so B + k is k * 0.02 s)."""
    B = BEGIN
    # two pairs, then text cut off: the tail is dropped, the next window starts at the last pair
    segments, advance = split_window([B + 10, 1, 2, B + 50, B + 50, 3, B + 90, B + 95, 4, 5], 3000, 3000, B)
    assert [s.tokens for s in segments] == [(B + 10, 1, 2, B + 50), (B + 50, 3, B + 90, B + 95)]
    assert [t for s in segments for t in (s.start, s.end)] == pytest.approx([30.2, 31.0, 31.0, 31.8])
    assert advance == 180
    # a single timestamp at the end: silence after it, the next window 30 s on
    segments, advance = split_window([B, 1, B + 40, B + 60, 2, B + 70], 0, 3000, B)
    assert [t for s in segments for t in (s.start, s.end)] == pytest.approx([0.0, 0.8, 1.2, 1.4])
    assert advance == 3000
    # no pair: one segment from the window's start to its last timestamp, or its end
    assert split_window([B + 5, 1, B + 30], 0, 1200, B) == ([TimedSegment(0.0, 0.6, (B + 5, 1, B + 30))], 1200)
    [segment], advance = split_window([B, 1, 2], 100, 1200, B)
    assert (segment.start, segment.end, advance) == pytest.approx((1.0, 13.0, 1200))
    # a last pair at <|0.00|> would start the next window where this one started: its end instead
    assert split_window([B, B, 1, 2], 0, 3000, B)[1] == 3000


# ---------------------------------------------------------------- the temperature fallback


def test_fallback_checks_are_transformers():
    W = transformers.WhisperForConditionalGeneration
    rng = np.random.default_rng(0)
    for tokens in ([5] * 40, rng.integers(0, 2013, 40).tolist(), [7, 8, 9, 7, 8, 9] * 8 + [404]):
        expected = W._retrieve_compression_ratio(torch.tensor(tokens), 2013)
        assert compression_ratio(tokens, 2013) == pytest.approx(expected)
    assert window_fails([5] * 40, -1.0, 40, 2013)                 # repetitive: ratio > 2.4
    assert not window_fails([1, 2, 3, 4], -3.9, 4, 2013) and window_fails([1, 2, 3, 4], -4.1, 4, 2013)


@pytest.mark.parametrize("granularities", [(), ("segment",)])
def test_a_failing_window_is_decoded_again_at_each_temperature(engine, checkpoint, granularities):
    """The random model's greedy window fails transformers' log-probability check (as HF's
    own helpers say): the window is decoded at 0.5, then at 1.0, which is kept. The greedy
    attempt's tokens (HF's) lead the stream; text and segments are the last attempt's."""
    _, model, tokenizer = checkpoint
    audio = clip("chirp", 11)
    timestamps = bool(granularities)
    out = model.generate(features(audio), language="en", task="transcribe", return_timestamps=timestamps,
                         force_unique_generate_call=True, return_dict_in_generate=True, output_scores=True)
    greedy = out.sequences[0][-len(out.scores):]
    W = transformers.WhisperForConditionalGeneration
    assert W._retrieve_avg_logprobs([s[0] for s in out.scores], greedy, 0.0) < -1.0     # HF would fall back
    request = TranscriptionRequest(audio, language="en", temperature=(0.0, 0.5, 1.0), seed=3,
                                   timestamp_granularities=granularities)
    result = transcribe(engine, request)
    first_attempt = [t for t in greedy.tolist() if t != model.generation_config.eos_token_id]
    assert result.token_ids[: len(first_attempt)] == first_attempt
    assert len(result.token_ids) > len(first_attempt) + 2 and result.finish_reason == "stop"
    assert result.segments and {s.temperature for s in result.segments} == {1.0}
    last_attempt = [t for s in result.segments for t in s.token_ids]
    texts = [tokenizer.decode([t for t in s.token_ids if t < BEGIN], skip_special_tokens=True).strip()
             for s in result.segments]
    assert result.text == " ".join(t for t in texts if t)
    assert result.token_ids[-len(last_attempt) - 1:-1] == last_attempt or timestamps   # then the EOS
    streamed = list(engine.submit(request))
    assert "".join(c.text for c in streamed) == result.text


def test_each_attempt_of_a_window_is_a_prefill_walk(engine):
    """The plan decodes the failing window again: one encode walk, a prefill walk per
    temperature (the window's encoder states are kept), the EOS emitted by `end`."""
    before = dict(engine.stats.walk_counts)
    result = transcribe(engine, TranscriptionRequest(clip("chirp", 11), language="en", temperature=(0.0, 0.5, 1.0),
                                                     seed=3))
    after = engine.stats.walk_counts
    counts = {name: after.get(name, 0) - before.get(name, 0) for name in ("encode", "prefill", "end")}
    assert result.usage.windows == 1 and counts == {"encode": 1, "prefill": 3, "end": 1}


# ---------------------------------------------------------------- word timestamps


@pytest.mark.parametrize("granularities", [("word",), ("word", "segment")])
def test_token_times_equal_hf_return_token_timestamps(engine, checkpoint, granularities):
    """Each token's time by cross-attention alignment (the checkpoint's alignment_heads)
    within 20 ms of transformers' return_token_timestamps on the same window (its
    attention mask: the audio's frames), and words cut from them."""
    _, model, tokenizer = checkpoint
    audio = clip("chirp", 11)
    timestamps = "segment" in granularities
    inputs = transformers.WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=16000, return_tensors="pt",
                                                                 return_attention_mask=True)
    out = model.generate(inputs.input_features, attention_mask=inputs.attention_mask, language="en",
                         task="transcribe", return_timestamps=timestamps, return_token_timestamps=True,
                         force_unique_generate_call=True, return_dict_in_generate=True)
    prompt_len = 3 if timestamps else 4
    expected = out["token_timestamps"][0].tolist()[prompt_len:]
    result = transcribe(engine, TranscriptionRequest(audio, language="en", timestamp_granularities=granularities))
    first_window = [s for s in result.segments if s.window == 0]
    times = [t for s in first_window for t in s.token_times]
    tokens = [t for s in first_window for t in s.token_ids]
    assert tokens == out["sequences"][0].tolist()[prompt_len:][: len(tokens)] and len(tokens) > 4
    assert max(abs(ours - theirs) for ours, theirs in zip(times, expected)) <= 0.02
    assert result.words and all(w.start <= w.end for w in result.words)
    assert [w.start for w in result.words] == sorted(w.start for w in result.words)
    assert "".join(w.word for w in result.words) == "".join(result.text.split())   # the words are the text


def test_dynamic_time_warping_is_transformers():
    """The diagonal-at-a-time DTW takes transformers' path, ties included."""
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping

    rng = np.random.default_rng(0)
    for matrix in (rng.standard_normal((12, 90)), rng.integers(0, 3, (30, 40)).astype(np.float64),
                   rng.standard_normal((1, 7)), rng.standard_normal((7, 1))):
        ours, theirs = dynamic_time_warping(matrix), _dynamic_time_warping(matrix)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
