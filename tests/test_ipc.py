"""The engine process's channel: pickle-5 frames over a socket pair, buffers out of band."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from omniwalk.ipc import OUT_OF_BAND_MIN_BYTES, Channel, ChannelClosed, encode
from omniwalk.messages import LoopStats, StepOutputs
from omniwalk.runtime import RequestOutput


@pytest.fixture
def pair():
    ours, theirs = Channel.pair()
    other = Channel(theirs)
    yield ours, other
    ours.close()
    other.close()


def test_arrays_and_tensors_cross_out_of_band(pair):
    ours, theirs = pair
    pcm = np.arange(4096, dtype=np.int16)
    message = {"pcm": pcm, "features": torch.randn(2, 80, 30), "bf16": torch.randn(3, 400).bfloat16(),
               "small": np.arange(3), "ids": torch.tensor([1, 2, 3]), "text": "hi"}
    pieces = encode(message)
    # header, pickle stream, then one piece per large buffer: pcm, features, bf16 (not the small ones)
    assert len(pieces) == 5 and [p.nbytes for p in pieces[2:]] == [pcm.nbytes, 2 * 80 * 30 * 4, 3 * 400 * 2]
    assert all(p.nbytes >= OUT_OF_BAND_MIN_BYTES for p in pieces[2:])
    ours.send(message)
    got = theirs.recv()
    assert np.array_equal(got["pcm"], pcm) and got["pcm"].flags.writeable
    assert torch.equal(got["features"], message["features"]) and got["bf16"].dtype == torch.bfloat16
    assert torch.equal(got["bf16"], message["bf16"]) and torch.equal(got["ids"], message["ids"])
    assert got["text"] == "hi" and np.array_equal(got["small"], np.arange(3))


def test_step_outputs_round_trip(pair):
    ours, theirs = pair
    outputs = [RequestOutput(f"r{i}", {("text", "tokens"): [i]}) for i in range(3)]
    outputs.append(RequestOutput("done", {("text", "tokens"): [7]}, True, "length", {"text": "length"}, {"text": 5}))
    outputs.append(RequestOutput("failed", finished=True, finish_reason="error", error="boom"))
    stats = LoopStats(steps=4, heartbeat=1.5, num_running=3, walk_counts={"decode": 2}, node_batches={"backbone": 4})
    ours.send(StepOutputs(outputs, stats))
    got = theirs.recv()
    assert got == StepOutputs(outputs, stats)


def test_a_message_larger_than_the_socket_buffers(pair):
    ours, theirs = pair
    big = [np.full(3_000_000, i, dtype=np.uint8) for i in range(4)]   # sent in parts while read
    sender = threading.Thread(target=ours.send, args=(big,))
    sender.start()
    got = theirs.recv()
    sender.join()
    assert [int(a[0]) for a in got] == [0, 1, 2, 3] and all(a.size == 3_000_000 for a in got)


def test_the_other_end_closing_is_channel_closed(pair):
    ours, theirs = pair
    ours.close()
    with pytest.raises(ChannelClosed):
        theirs.recv()
    with pytest.raises(ChannelClosed):
        theirs.send("anyone?")


def test_what_does_not_pickle_raises_at_the_sender(pair):
    ours, theirs = pair
    with pytest.raises(Exception):
        ours.send(lambda: None)
    ours.send("next")            # the channel is still usable
    assert theirs.recv() == "next"
