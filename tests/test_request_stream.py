"""An asyncio consumer of a RequestStream that fell behind reads what is queued as one chunk."""

import asyncio

from omniwalk.api import RequestStream
from omniwalk.capabilities.speech import SpeechChunk
from omniwalk.capabilities.text import GenerationChunk


def _read_after(chunks):
    """Iterate a stream whose chunks all arrived before its consumer looked."""
    async def consume():
        stream = RequestStream(engine=None, request_id="r", prompt_token_ids=[1], loop=asyncio.get_running_loop())
        for chunk in chunks:
            stream._deliver(chunk)
        return [chunk async for chunk in stream]
    return asyncio.run(consume())


def test_queued_text_chunks_join_into_one_and_an_error_comes_on_its_own():
    ids = [[5], [6, 7], [8]]
    chunks = [GenerationChunk("r", t, f"<{t[0]}>", [None] * len(t), audio=bytes(t)) for t in ids]
    joined = _read_after([*chunks, GenerationChunk("r", [9], "!", [None], finished=True, finish_reason="length",
                                                   stop_reason=None)])
    assert len(joined) == 1 and joined[0].finished and joined[0].finish_reason == "length"
    assert joined[0].token_ids == [5, 6, 7, 8, 9] and joined[0].text == "<5><6><8>!"
    assert joined[0].logprobs == [None] * 5 and joined[0].audio == bytes([5, 6, 7, 8])
    # an error after output: the output first, then the error alone (its event after the text)
    error = GenerationChunk("r", [], "", [], finished=True, finish_reason="error", error="boom")
    split = _read_after([*chunks, error])
    assert [c.token_ids for c in split] == [[5, 6, 7, 8], []] and split[1].error == "boom"


def test_queued_speech_chunks_join():
    pcm = [b"\x01\x00", b"\x02\x00\x03\x00"]
    joined = _read_after([SpeechChunk("r", pcm[0], [1]), SpeechChunk("r", pcm[1], [2, 3], finished=True,
                                                                     finish_reason="stop")])
    assert len(joined) == 1 and joined[0].pcm == b"".join(pcm) and joined[0].token_ids == [1, 2, 3]
    assert joined[0].finish_reason == "stop"
