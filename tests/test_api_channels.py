"""The engine process's side of several API processes (omniwalk/api_channels.py), over real
socket pairs in one process: each output reaches the API process that added its request,
the stats reach all, an inspection's answer reaches who asked, and an API process that
leaves only loses its own requests."""

from __future__ import annotations

import socket

import pytest

from omniwalk.api_channels import ApiChannels
from omniwalk.engine_loop import Inbox
from omniwalk.ipc import Channel
from omniwalk.messages import (
    Abort, AddRequest, Inspect, InspectResult, LoopFailed, LoopStats, Shutdown, StepOutputs,
)
from omniwalk.runtime import Request, RequestOutput


@pytest.fixture
def wired():
    """(the ApiChannels, the loop's inbox, the channels of API processes 0 and 1)."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    inbox = Inbox()
    channels = ApiChannels(tuple(theirs.detach() for _, theirs in pairs), inbox)
    channels.start()
    for ours, _ in pairs:
        ours.settimeout(5)   # a message that never comes fails the test (ChannelClosed) instead of hanging it
    apis = [Channel(ours) for ours, _ in pairs]
    yield channels, inbox, apis
    channels.close(timeout=2)
    for api in apis:
        api.close()


def add(api: Channel, inbox: Inbox, request_id: str) -> None:
    api.send(AddRequest(Request(request_id, None, {})))
    assert inbox.commands.get(timeout=5).request.request_id == request_id


def test_outputs_go_to_their_api_process_and_stats_to_all(wired):
    channels, inbox, (api0, api1) = wired
    add(api0, inbox, "a")
    add(api1, inbox, "b")
    step = LoopStats(steps=1, heartbeat=10.0)
    channels.send(StepOutputs([RequestOutput("a", {("main", "text"): [1]}), RequestOutput("b")], step))
    got0, got1 = api0.recv(), api1.recv()
    assert [out.request_id for out in got0.outputs] == ["a"] and got0.stats == step
    assert [out.request_id for out in got1.outputs] == ["b"] and got1.stats == step

    # a step with outputs of api 0 only: api 1 gets its stats alone, once per STATS_INTERVAL_S
    later = LoopStats(steps=2, heartbeat=11.0)
    channels.send(StepOutputs([RequestOutput("a", finished=True, finish_reason="length")], later))
    channels.send(StepOutputs([RequestOutput("b", {("main", "text"): [2]})], LoopStats(steps=3, heartbeat=11.01)))
    assert api0.recv().outputs[0].finished
    assert api1.recv() == later
    assert [out.request_id for out in api1.recv().outputs] == ["b"]
    # "a" has finished: an abort's late record for it goes nowhere (api 0 next reads the failure)
    channels.send(StepOutputs([RequestOutput("a", finished=True, finish_reason="abort")]))
    channels.send(LoopFailed("boom"))
    assert api0.recv() == LoopFailed("boom") and api1.recv() == LoopFailed("boom")


def test_an_inspection_answers_who_asked(wired):
    channels, inbox, (api0, api1) = wired
    api0.send(Inspect(7, len))
    asked_by_0 = inbox.commands.get(timeout=5)
    api1.send(Inspect(7, len))
    asked_by_1 = inbox.commands.get(timeout=5)
    assert asked_by_0.token != asked_by_1.token   # each API process numbers its own: renumbered
    channels.send(InspectResult(asked_by_1.token, value="for api 1"))
    channels.send(InspectResult(asked_by_0.token, value="for api 0"))
    assert api1.recv() == InspectResult(7, value="for api 1")
    assert api0.recv() == InspectResult(7, value="for api 0")


def test_an_id_in_flight_elsewhere_is_refused_and_a_leaving_api_process_loses_its_requests(wired):
    channels, inbox, (api0, api1) = wired
    add(api0, inbox, "a")
    api1.send(AddRequest(Request("a", None, {})))
    refused = api1.recv().outputs[0]
    assert refused.request_id == "a" and refused.finished and "duplicate request id" in refused.error
    add(api1, inbox, "b")

    api1.send(Shutdown())   # its server stops: the engine aborts its requests and serves on
    assert inbox.commands.get(timeout=5) == Abort("b")
    channels.send(StepOutputs([RequestOutput("a", {("main", "text"): [1]})]))
    assert api0.recv().outputs[0].request_id == "a"
    assert inbox.commands.empty()   # no Shutdown of the loop
