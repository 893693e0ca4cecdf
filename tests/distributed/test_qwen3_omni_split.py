"""Qwen3-Omni's Talker and Code2Wav in a worker process of their own, the Thinker in the
engine process (issue 27, qwen3_omni_split.yaml): the Talker keeps per-stream state (its KV
cache, its rows), so its begin, reserve, preempt and release cross to the worker as its
batches do (omniwalk/node_workers.py). A spoken answer has the text ids and the audio bytes
of one process; a killed worker ends the request in flight and /health answers 503. One
placed engine for the module (killed by the last test)."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest
from omni_speech import ARGS, GREEDY, chat, speak
from pids import alive
from split_speech import check_a_killed_worker_ends_its_requests

from omniwalk.api import Engine
from omniwalk.capabilities.text import GenerationRequest, SpeechOutput
from omniwalk.loading import EngineArgs
from omniwalk.placement import load_placement

SPLIT = Path(__file__).with_name("qwen3_omni_split.yaml")


@functools.cache
def one_process_speech() -> list:
    with Engine(EngineArgs("tiny-qwen3-omni", **ARGS)) as one:
        return speak(one)


@pytest.fixture(scope="module")
def placed():
    engine = Engine(EngineArgs("tiny-qwen3-omni", engine_process=True, placement=load_placement(SPLIT), **ARGS))
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
    got = speak(placed)
    assert got == expected
    assert [len(ids) for ids, *_ in got] == [6, 3, 2] and all(audio for _, audio, *_ in got)
    # every frame of the budget, spoken: F frames are F * 96 - 32 samples of tiny-qwen3-omni's Code2Wav
    assert got[0][3].audio_frames == 10 and len(got[0][1]) == 2 * (10 * 96 - 32)
    assert placed.stats.node_batches["talker"] > 10 and placed.stats.node_batches["code2wav"] >= 2


def test_a_killed_speech_worker_ends_its_request_and_health_answers_503(placed):
    long = GenerationRequest(prompt=chat(placed, "Killed mid-way"), max_tokens=1500, ignore_eos=True,
                             sampling=GREEDY, speech=SpeechOutput("ethan", None, GREEDY))
    check_a_killed_worker_ends_its_requests(placed, lambda: os.kill(placed.worker_pids[0], signal.SIGKILL),
                                            "killed by SIGKILL", group="speech", request=long)
