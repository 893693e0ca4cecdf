"""Whisper's encoder in a worker process of its own (issue 27, omniwalk/node_workers.py): the
transcripts of one process, with language detection and timestamps; each window's features
go to the worker and its encoder states come back through the tensor edge (gloo), not the
socket (omniwalk/tensor_edges.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from edge_traffic import edge_traffic

from omniwalk.api import Engine
from omniwalk.capabilities.transcription import TranscriptionRequest, transcribe
from omniwalk.loading import EngineArgs
from omniwalk.placement import load_placement

SPLIT = Path(__file__).with_name("whisper_split.yaml")


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


REQUESTS = [TranscriptionRequest(tone(3, 220), max_output_tokens=16),   # language detected
            TranscriptionRequest(tone(7, 440), language="en", max_output_tokens=10,
                                 timestamp_granularities=("segment",))]


def transcripts(engine: Engine) -> list:
    results = [transcribe(engine, request) for request in REQUESTS]   # one at a time: batches as in one process
    return [(r.token_ids, r.finish_reason) for r in results]


def encoder_here(runtime) -> str:   # run in the engine process by Engine.inspect
    return type(runtime.model.executors["encoder"]).__name__


def placed_config():
    from omniwalk.loading import read_model

    return read_model(EngineArgs("tiny-whisper")).config


def test_whisper_encoder_in_a_worker_gives_the_transcripts_of_one_process():
    args = dict(kv_cache_tokens=8192, max_num_seqs=4)
    with Engine(EngineArgs("tiny-whisper", **args)) as one:
        expected = transcripts(one)
    with Engine(EngineArgs("tiny-whisper", engine_process=True, placement=load_placement(SPLIT), **args)) as placed:
        assert placed.inspect(encoder_here) == "RemoteExecutor"
        before = placed.inspect(functools.partial(edge_traffic, "encoder"))
        assert transcripts(placed) == expected
        after = placed.inspect(functools.partial(edge_traffic, "encoder"))
        assert placed.stats.node_batches["encoder"] >= len(REQUESTS)   # the runtime batched it as before
    assert sum(len(ids) for ids, _ in expected) > 15
    # one window each through the group: its features there ([1, mels, 3000] float32), its
    # encoder states back ([1, 1500, d_model] float32)
    sent, received, bytes_sent, bytes_received = (a - b for a, b in zip(after, before))
    config = placed_config()
    assert sent == received == len(REQUESTS)
    assert bytes_sent == len(REQUESTS) * config.num_mel_bins * 3000 * 4
    assert bytes_received == len(REQUESTS) * config.max_source_positions * config.d_model * 4
