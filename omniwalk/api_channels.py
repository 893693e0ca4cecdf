"""The engine process's side of several API processes (`omniwalk serve --api-server-count N`,
omniwalk/server/api_servers.py): one channel each, one engine loop for all.

    API process i --AddRequest / Abort / Inspect--> input thread i --> Inbox --> EngineLoop
                                                    (owner[request id] = i; Inspect tokens renumbered)
    API process i <--its outputs, the stats-------- writer thread i <-- queue i <-- ApiChannels.send
                                                                        (on the loop thread: split by owner)

What goes where: a request's outputs to the API process that added it (the owner is set
when its `AddRequest` is read, before the loop can see it, and dropped with its final
record); `LoopStats` and `LoopFailed` to every API process (each one's /metrics, /health and
stats line read them), and a step's stats also to those with no output in it, at most every
`EngineLoop.STATS_INTERVAL_S`; an `InspectResult` to whoever asked. Request ids are the API
processes' own (each prefixes its generated ones; the server's are uuids): an id another API
process has in flight is refused.

An API process that leaves (`Shutdown` on its channel, or end of file: it stopped or died)
only loses its requests, which are aborted: the loop serves the others. The engine stops on
the supervisor's channel (`Shutdown`, or its end of file), as it stops with one API process.

Why a writer thread per channel rather than one that demultiplexes: an API process that
reads slowly (its interpreter busy tokenizing a long prompt, say) fills its socket buffer
(4 MB) and blocks its writer; with one writer every other API process would wait behind it.
The split itself runs on the loop thread, where the outputs are made: a dict lookup and an
append per output, 33 us (median) for a step of 128 outputs over 4 API processes on the CPU
host, a few tenths of a percent of a decode step. A router thread would move that off the
loop thread but not off the interpreter lock the two share, and add a wake-up per step (9 us
median on the same host), so the split has no thread of its own.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import replace

from omniwalk.ipc import Channel
from omniwalk.messages import (
    Abort, AddRequest, EngineOutput, Inspect, InspectResult, Shutdown, StepOutputs,
)
from omniwalk.runtime import FinishReason, RequestOutput

logger = logging.getLogger(__name__)


class _Link:
    """One API process's channel, its outputs' queue and writer, and when it last got stats."""

    def __init__(self, index: int, channel: Channel):
        self.index = index
        self.channel = channel
        self.outbox: queue.SimpleQueue[EngineOutput | None] = queue.SimpleQueue()
        self.closed = False          # its API process is gone: nothing more is queued for it
        self.stats_sent = 0.0

    def put(self, message: EngineOutput) -> None:
        if not self.closed:
            self.outbox.put(message)


class ApiChannels:
    """The channels of the API processes (their inherited descriptors `fds`, API process i on
    fds[i]). `send` is the loop's: it routes each output to its API process."""

    def __init__(self, fds: tuple[int, ...], inbox):
        from omniwalk.engine_loop import EngineLoop

        self.inbox = inbox
        self.links = [_Link(index, Channel.inherited(fd)) for index, fd in enumerate(fds)]
        self.owner: dict[str, _Link] = {}                        # request id -> its API process
        self.inspections: dict[int, tuple[_Link, int]] = {}      # our token -> (asker, its token)
        self._tokens = itertools.count()
        self._stats_interval_s = EngineLoop.STATS_INTERVAL_S
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Reads commands and writes outputs from now on (the model is loaded)."""
        from omniwalk.engine_process import _write_outputs

        for link in self.links:
            reader = threading.Thread(target=self._read, args=(link,), name=f"omniwalk-api-{link.index}-input",
                                      daemon=True)
            writer = threading.Thread(target=self._write, args=(link, _write_outputs),
                                      name=f"omniwalk-api-{link.index}-output", daemon=True)
            reader.start()
            writer.start()
            self._threads.append(writer)

    def close(self, timeout: float = 10.0) -> None:
        """After the loop: what is queued is written, then every channel closed (end of file
        tells each API process that the engine is gone)."""
        for link in self.links:
            link.outbox.put(None)
        deadline = time.monotonic() + timeout
        for writer in self._threads:
            writer.join(timeout=max(0.0, deadline - time.monotonic()))
        for link in self.links:
            link.channel.close()

    # ------------------------------------------------------------ loop -> API processes

    def send(self, message: EngineOutput) -> None:
        """The loop's `send` (on the loop thread)."""
        if isinstance(message, StepOutputs):
            self._route_step(message)
        elif isinstance(message, InspectResult):
            asker = self.inspections.pop(message.token, None)
            if asker is not None:
                link, token = asker
                link.put(replace(message, token=token))
        else:   # LoopStats, LoopFailed: everyone's
            for link in self.links:
                link.put(message)

    def _route_step(self, step: StepOutputs) -> None:
        by_link: dict[_Link, list[RequestOutput]] = {}
        owner = self.owner
        for out in step.outputs:
            link = owner.get(out.request_id)
            if link is None:   # an abort's record after the request's end, or its API process left
                continue
            if out.finished:
                del owner[out.request_id]
            by_link.setdefault(link, []).append(out)
        stats = step.stats
        now = stats.heartbeat if stats is not None else 0.0
        for link in self.links:
            outputs = by_link.get(link)
            if outputs:
                link.put(StepOutputs(outputs, stats))
                link.stats_sent = now
            elif stats is not None and now - link.stats_sent >= self._stats_interval_s:
                link.put(stats)   # an API process with nothing in this step still sees the loop move
                link.stats_sent = now

    def _write(self, link: _Link, write_outputs) -> None:
        write_outputs(link.channel, link.outbox, self.inbox)
        link.closed = True

    # ------------------------------------------------------------ API processes -> loop

    def _read(self, link: _Link) -> None:
        """Input thread i: API process i's commands into the loop's inbox until it leaves."""
        from omniwalk.engine_process import commands

        left = "is gone"
        for command in commands(link.channel):
            if isinstance(command, Shutdown):   # its server stops; only the supervisor stops the engine
                left = "left"
                break
            command = self._admit(link, command)
            if command is not None:
                self.inbox.put(command)
        link.closed = True
        ids = [request_id for request_id, owner in self.owner.copy().items() if owner is link]
        for request_id in ids:
            self.inbox.put(Abort(request_id))
        (logger.info if left == "left" else logger.warning)("api %d %s: %d of its requests aborted", link.index,
                                                             left, len(ids))

    def _admit(self, link: _Link, command):
        """The command as the loop takes it, with its owner noted; None when refused."""
        if isinstance(command, AddRequest):
            request_id = command.request.request_id
            if self.owner.setdefault(request_id, link) is not link:
                link.put(StepOutputs([RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR,
                                                    error=f"duplicate request id {request_id!r}")]))
                return None
        elif isinstance(command, Inspect):   # each API process numbers its own
            token = next(self._tokens)
            self.inspections[token] = (link, command.token)
            return replace(command, token=token)
        return command
