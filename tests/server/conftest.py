"""The server fixtures: engines and servers on loopback ports (running.py runs them), shared by
a module or, for the speech and transcription models, by the whole session."""

from __future__ import annotations

import httpx
import pytest
from running import launch

from omniwalk.loading import EngineArgs


@pytest.fixture(scope="session")
def launch_server():
    """`with launch_server(EngineArgs(...)) as running:` for tests that need their own engine."""
    return launch


@pytest.fixture(scope="session")
def whisper_server():
    """tiny-whisper, shared by every module that transcribes (one engine process for the session)."""
    with launch(EngineArgs("tiny-whisper", max_num_seqs=16)) as running:
        yield running


@pytest.fixture(scope="session")
def tts_server():
    """tiny-orpheus, shared by every module that speaks."""
    with launch(EngineArgs("tiny-orpheus")) as running:
        yield running


@pytest.fixture(scope="module")
def server():
    with launch(EngineArgs("tiny-qwen3")) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
