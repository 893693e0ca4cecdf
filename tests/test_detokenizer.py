"""Incremental detokenization: deltas join to the full decode, never split a character."""

import pytest

from omniwalk.detokenizer import IncrementalDetokenizer
from omniwalk.loading import EngineArgs, load_model

TEXTS = ["Hello there! A plain sentence, with punctuation.",
         "ünïcödé 日本語のテキスト and emoji 🦊🎉 mixed in",
         "  leading spaces\nnew lines\tand tabs  "]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(EngineArgs("tiny-qwen3", device="cpu")).tokenizer


class PythonOnly:
    """The same tokenizer seen without its fast backend: the windowed Python path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("path", ["decode_stream", "window"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode_without_split_characters(tokenizer, path, text):
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode(text) + [special] + tokenizer.encode(" tail")
    detokenizer = IncrementalDetokenizer(tokenizer if path == "decode_stream" else PythonOnly(tokenizer))
    assert (detokenizer._stream is not None) == (path == "decode_stream")
    deltas = [detokenizer.add(i) for i in ids] + [detokenizer.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("path", ["decode_stream", "window"])
def test_flush_returns_what_was_held_back(tokenizer, path):
    ids = tokenizer.encode("🦊")
    assert len(ids) > 1                            # byte-level pieces of one character
    detokenizer = IncrementalDetokenizer(tokenizer if path == "decode_stream" else PythonOnly(tokenizer))
    held = [detokenizer.add(i) for i in ids[:-1]]
    assert "".join(held) == ""                     # an incomplete character is held back
    assert detokenizer.add(ids[-1]) + detokenizer.flush() == "🦊"


@pytest.mark.parametrize("path", ["decode_stream", "window"])
def test_random_ids_join_to_the_full_decode(tokenizer, path):
    """Ids as a random-weight model emits them (byte pieces that never form a character
    included): the joined deltas are still exactly the full decode."""
    import random
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detokenizer = IncrementalDetokenizer(tokenizer if path == "decode_stream" else PythonOnly(tokenizer))
        joined = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
        assert joined == tokenizer.decode(ids, skip_special_tokens=True)
