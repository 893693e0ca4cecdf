"""A family from a test folder, registered at run time, served over real HTTP without a
line of omniwalk/server knowing it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from omniwalk import Engine, EngineArgs
from omniwalk.capabilities import Capability
from omniwalk.models import registry

sys.path.insert(0, str(Path(__file__).parent))
from toy_family import REVERSE_FAMILY  # noqa: E402


def _server_helpers():
    """tests/server/running.py (a real server on a loopback port), loaded by path."""
    spec = importlib.util.spec_from_file_location("server_helpers", Path(__file__).parents[1] / "server" / "running.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launch = _server_helpers().launch


@pytest.fixture
def reverse_family():
    registry.register(REVERSE_FAMILY)
    yield REVERSE_FAMILY
    registry.unregister(REVERSE_FAMILY.name)


def test_a_registered_family_is_served_over_http(reverse_family):
    with launch(EngineArgs("tiny-reverse", startup_warmup=True)) as server:
        assert server.engine.capabilities == {Capability.TEXT}
        prompt = [5, 6, 7, 8]
        answer = httpx.post(server.url + "/generate", json={"prompt_token_ids": prompt, "max_output_tokens": 6,
                                                            "ignore_eos": True}).json()
        assert answer["token_ids"] == [8, 7, 6, 5, 8, 7]   # the prompt reversed, cycling: the family's plan
        assert answer["finish_reason"] == "length"          # the runtime's budget, not the family's

        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        completion = client.completions.create(model="tiny-reverse", prompt=prompt, max_tokens=3,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = completion.choices[0]
        assert choice.model_extra["token_ids"] == [8, 7, 6] and completion.usage.completion_tokens == 3
        assert choice.text == server.engine.tokenizer.decode([8, 7, 6])

        speech = httpx.post(server.url + "/v1/audio/speech", json={"model": "tiny-reverse", "input": "hi"})
        assert speech.status_code == 400 and "does not produce speech" in speech.json()["error"]["message"]
        server.wait_idle()


def test_registering_twice_is_refused(reverse_family):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(REVERSE_FAMILY)


def test_a_request_of_a_capability_the_model_lacks_is_a_value_error(reverse_family):
    from omniwalk import SpeechRequest

    with Engine(EngineArgs("tiny-reverse")) as engine:
        with pytest.raises(ValueError, match="does not produce speech"):
            engine.submit(SpeechRequest("hello"))
