"""Qwen3-Omni's Talker and Code2Wav in a worker process of their own, the Thinker in the
engine process (issue 27, qwen3_omni_split.yaml): the Talker keeps per-stream state (its KV
cache, its rows), so its begin, reserve, preempt and release cross to the worker as its
batches do (omniwalk/node_workers.py). A spoken answer has the text ids and the audio bytes
of one process; the Thinker's hidden states at an image's rows reach the Talker through the
tensor edge (gloo; omniwalk/tensor_edges.py), not the socket; a killed worker ends the
request in flight and /health answers 503. One placed engine for the module (killed by the
last test)."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest
from edge_traffic import edge_traffic
from omni_speech import ARGS, GREEDY, PICTURE, chat, speak
from pids import alive
from split_speech import check_a_killed_worker_ends_its_requests

from omniwalk.api import Engine
from omniwalk.capabilities import Capability
from omniwalk.capabilities.media import ImageInput
from omniwalk.capabilities.text import GenerationRequest, SpeechOutput
from omniwalk.loading import EngineArgs
from omniwalk.placement import load_placement
from omniwalk.tensor_edges import MIN_BYTES_ENV

SPLIT = Path(__file__).with_name("qwen3_omni_split.yaml")


@functools.cache
def one_process_speech() -> list:
    with Engine(EngineArgs("tiny-qwen3-omni", **ARGS)) as one:
        return speak(one)


@pytest.fixture(scope="module")
def placed():
    # every tensor through the edge, however small: tiny-qwen3-omni's hidden states are 256 bytes a row
    with pytest.MonkeyPatch.context() as env:
        env.setenv(MIN_BYTES_ENV, "1")   # the engine process, and its worker, read it as they start
        engine = Engine(EngineArgs("tiny-qwen3-omni", engine_process=True, placement=load_placement(SPLIT),
                                   **ARGS))
    try:
        yield engine
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in (engine.engine_pid, *engine.worker_pids))


def speech_here(runtime) -> tuple:   # run in the engine process by Engine.inspect
    model = runtime.model
    executors = model.executors
    return (type(executors["talker"]).__name__, type(executors["code2wav"]).__name__,
            type(executors["thinker"]).__name__, len(model.speech.executors))


def test_talker_and_code2wav_in_a_worker_give_the_ids_and_audio_of_one_process(placed):
    (worker,) = placed.worker_pids
    assert alive(worker) and worker != placed.engine_pid
    # the engine process built no Talker or Code2Wav executor (nor the Talker's cache) of its own
    assert placed.inspect(speech_here) == ("RemoteExecutor", "RemoteExecutor", "ThinkerExecutor", 0)
    expected = one_process_speech()
    before = placed.inspect(functools.partial(edge_traffic, "talker"))
    got = speak(placed)
    after = placed.inspect(functools.partial(edge_traffic, "talker"))
    assert got == expected
    # the image's rows of the Thinker's hidden states ([m, 64] float32), with the talker stream's
    # begin and in its first batch, through the group; nothing comes back as a tensor (audio: PCM)
    sent, received, bytes_sent, _ = (a - b for a, b in zip(after, before))
    assert sent == 2 and received == 0 and bytes_sent > 0 and bytes_sent % (2 * 64 * 4) == 0
    assert [len(ids) for ids, *_ in got] == [6, 3, 2] and all(audio for _, audio, *_ in got)
    # every frame of the budget, spoken: F frames are F * 96 - 32 samples of tiny-qwen3-omni's Code2Wav
    assert got[0][3].audio_frames == 10 and len(got[0][1]) == 2 * (10 * 96 - 32)
    assert placed.stats.node_batches["talker"] > 10 and placed.stats.node_batches["code2wav"] >= 2


def test_a_killed_speech_worker_ends_its_request_and_health_answers_503(placed):
    # about an image: its hidden states went to the worker through the edge before the kill
    image = placed.frontend(Capability.TEXT).media_markers["image"]
    long = GenerationRequest(prompt=chat(placed, f"{image}Killed mid-way"), media=(ImageInput(PICTURE, "image 0"),),
                             max_tokens=1500, ignore_eos=True, sampling=GREEDY,
                             speech=SpeechOutput("ethan", None, GREEDY))
    check_a_killed_worker_ends_its_requests(placed, lambda: os.kill(placed.worker_pids[0], signal.SIGKILL),
                                            "killed by SIGKILL", group="speech", request=long)
