"""The runtime: request lifecycle and continuous batching across nodes and walks.

Scheduling model. A request is admitted when a running slot is free (`max_num_seqs`);
each of its streams then steps through the walks its model's plan chooses. One `step()`:

  1. admit waiting requests: budgets become loop caps, streams are created;
  2. advance every stream that can move without running a node: edges to the client,
     keeps, pushes into other streams' buffers, loop control, a walk ended early
     (`EndWalkIf`), and at a walk's end the plan's choice of the next walk. A stream
     stops at the next node it must run;
  3. for every node with streams waiting at it (later stages first), form one batch:
     single-unit work (decode steps) first, then by admission order, within the node's
     token budget and batch size. Prefill work is chunked where the node allows it, so
     one batch mixes prefill chunks and decode steps. A running stream whose resources
     do not fit preempts the youngest stream holding state on that node (its work is
     recomputed);
  4. run each batch; a call whose work is complete writes its outputs and runs the
     edges after the node at once. A stream they lead back to the same node (a decode
     loop: emit, loop back, run the node again) starts its next call there and stays
     put; any other stream is left for phase 5. Streams at one place of one walk run
     each instruction together; one an instruction raises for leaves the group. An
     exception fails only the requests it belongs to;
  5. advance the streams that moved, and return this step's outputs per request.

Edges run as soon as the call before them is done: they touch only their stream, its
request's output and its consumers' buffers, so running them in phase 4 changes no batch.
Arriving at another node or starting a walk could, so those wait for phase 5. A decode
stream back at its node waits there for the next step, as it would have after phase 5.

The runtime knows a model only through its `ModelGraph`, its plan and its node
executors; stops and budgets are checked here, never in model code.
"""

from __future__ import annotations

import itertools
import logging
import operator
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from omniwalk.graph.chunking import StreamBuffer
from omniwalk.graph.compiled import EmitToClient, EndWalk, EnterLoop, KeepValue, LoopBack, PushToStream
from omniwalk.graph.model_graph import WAIT, ModelGraph, StreamView, WalkCall
from omniwalk.graph.primitives import Node
from omniwalk.runtime.executor import NodeCall, NodeExecutor
from omniwalk.runtime.request import FinishReason, Request, RequestOutput, StreamParams
from omniwalk.runtime.streams import RequestState, StreamState

logger = logging.getLogger(__name__)
_ADMISSION_ORDER = operator.attrgetter("order")


class ServedModel(Protocol):
    """What the runtime needs from a model."""

    graph: ModelGraph
    executors: dict[str, NodeExecutor]

    def plan(self, view: StreamView) -> WalkCall | None | Any: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64                # requests running at once
    max_num_batched_tokens: int = 2048    # work units per node batch
    max_queue: int = 1024                 # requests waiting for admission

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue`: the caller should back off (HTTP 429)."""


class Runtime:
    def __init__(self, model: ServedModel, config: SchedulerConfig = SchedulerConfig()):
        self.model = model
        self.graph = model.graph
        self.executors = model.executors
        missing = set(self.graph.nodes) - set(self.executors)
        if missing:
            raise ValueError(f"no executor for node(s) {sorted(missing)}")
        self.config = config
        # by id, in arrival order (an OrderedDict: taking the oldest stays O(1) where a
        # dict's first key is found past every entry deleted before it)
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: dict[str, RequestState] = {}
        # A step runs the nodes' batches later stages first (the reverse of their order in
        # the walks), so the work nearest the client is queued on the GPU first: an Orpheus
        # step launches its SNAC windows before the backbone's next decode step, and the
        # audio does not wait behind it. The order changes no batch (a stream reaches
        # another node only in phase 5).
        self.at_node: dict[str, dict[int, StreamState]] = {name: {} for name in reversed(self.graph.nodes)}
        self.dirty: dict[int, StreamState] = {}
        self._edge_failures: list[tuple[StreamState, Exception]] = []   # see _run_until_node
        self.outputs: dict[str, RequestOutput] = {}
        # counters the tests and /metrics read
        self.walk_counts: Counter[str] = Counter()
        self.node_batches: Counter[str] = Counter()
        self.num_preemptions = 0
        self._handles = itertools.count()
        self._orders = itertools.count()
        # per walk, per instruction: the method that runs it, None for a RunNode (where a
        # stream stops); looked up once here, not per instruction per stream per step
        self._handlers = {name: tuple(self._HANDLERS.get(type(instruction)) for instruction in walk.program)
                          for name, walk in self.graph.compiled.items()}

    # ---------------------------------------------------------------- public API

    def add_request(self, request: Request) -> None:
        if request.request_id in self.running or request.request_id in self.waiting:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        for name, spec in self.graph.streams.items():
            params = request.streams.get(name)
            if spec.budget is not None and (params is None or params.max_items is None):
                raise ValueError(f"stream {name!r} needs an output limit")
        unknown = set(request.streams) - set(self.graph.streams)
        if unknown:
            raise ValueError(f"unknown stream(s) {sorted(unknown)}")
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting (max_queue)")
        self.waiting[request.request_id] = request

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is; frees everything it holds. False if unknown."""
        if self.waiting.pop(request_id, None) is not None:
            out = self._output_for(request_id)
            out.finished, out.finish_reason = True, FinishReason.ABORT
            return True
        state = self.running.get(request_id)
        if state is None:
            return False
        self._end_request(state, FinishReason.ABORT)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.outputs)

    def step(self) -> list[RequestOutput]:
        self._admit_waiting()
        self._advance_dirty()
        for node_name, waiting_here in self.at_node.items():
            if waiting_here:
                calls = self._form_batch(node_name, list(waiting_here.values()))
                if calls:
                    self._run_batch(node_name, calls)
        self._advance_dirty()
        if not self.running:
            for executor in self.executors.values():
                executor.idle()
        outputs, self.outputs = list(self.outputs.values()), {}
        return outputs

    # ---------------------------------------------------------------- admission

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popitem(last=False)[1]
            state = RequestState(request, next(self._orders))
            for name, spec in self.graph.streams.items():
                params = request.streams.get(name, StreamParams())
                caps = {}
                if spec.budget is not None:
                    caps[spec.budget.loop] = max(0, params.max_items - spec.budget.items_before_loop)
                edge = self.graph.edges_by_consumer.get(name)
                stream = StreamState(
                    handle=next(self._handles), name=name, spec=spec, params=params, owner=state,
                    request_id=request.request_id, order=state.order,
                    budgeted_value=spec.budget.value if spec.budget is not None else None,
                    caps=caps, buffer=StreamBuffer(edge.policy) if edge else None,
                )
                state.streams[name] = stream
                self.dirty[stream.handle] = stream
            self.running[request.request_id] = state

    # ---------------------------------------------------------------- advancing walks

    def _advance_dirty(self) -> None:
        while self.dirty:
            _, stream = self.dirty.popitem()
            if not stream.is_finished:   # streams of ended requests are marked finished too
                try:
                    self._advance(stream)
                except Exception as exc:  # a model plan or a node's prepare failed
                    self._fail_request(stream, exc, "while advancing")

    def _advance(self, stream: StreamState) -> None:
        """Run the stream's instructions until it must wait for a node, a chunk, or ends."""
        while not stream.is_finished:
            walk = stream.walk
            if walk is None:
                if stream.finish_reason is not None or not self._start_next_walk(stream):
                    if stream.finish_reason is not None:
                        self._finish_stream(stream)
                    return
                continue
            failures = self._run_until_node([stream])
            if failures:
                self._fail_request(stream, failures[0][1], "in an edge")
                return
            if stream.pc < len(walk.program):   # at a RunNode
                self._arrive_at_node(stream, walk.program[stream.pc].node)
                return
            stream.last_walk, stream.walk = walk.name, None

    def _run_until_node(self, streams: list[StreamState]) -> list[tuple[StreamState, Exception]]:
        """Run the streams' edge and loop instructions up to each one's next RunNode or its
        walk's end. The streams start at one pc of one walk and run each instruction
        together (a decode batch: every stream at the same place), so an instruction is
        looked up once per batch, not once per stream; a loop instruction may part them.

        A stream an instruction raised for (an item its stop check cannot take) leaves its
        group there; returned with the exception, for the caller to fail its request."""
        failures = self._edge_failures = []
        groups = [streams]
        while groups:
            group = groups.pop()
            walk = group[0].walk
            program, handlers = walk.program, self._handlers[walk.name]
            end, pc = len(program), group[0].pc
            while pc < end:
                handler = handlers[pc]
                if handler is None:   # a RunNode
                    break
                known = len(failures)
                parted = handler(self, group, program[pc])   # moves every stream's pc on
                if len(failures) > known:
                    gone = {id(stream) for stream, _ in failures}
                    parted = [kept for part in (parted or [group]) if (kept := [s for s in part if id(s) not in gone])]
                    if not parted:
                        break
                if parted is not None:   # a loop instruction: [those at one pc, those at another]
                    group, *rest = parted
                    groups.extend(rest)
                pc = group[0].pc
        return failures

    # Each handler runs one instruction for streams at one pc and moves their pc on; one
    # that raises for a stream records it in `_edge_failures` and goes on with the others.
    # The loop instructions and EndWalk return the streams grouped by where they went (non-empty groups).

    def _emit_to_client(self, streams: list[StreamState], instruction: EmitToClient) -> None:
        value, modality, deferred, outputs = instruction.value, instruction.modality, instruction.deferred, self.outputs
        for stream in streams:
            try:
                item = stream.env[value]
                stream.pc += 1
                budgeted = value == stream.budgeted_value   # counted and stop-checked, even if None
                if budgeted:
                    params = stream.params
                    reason = params.stop.check(item, stream.count, params.max_items)
                    stream.count += 1
                    if reason is not None and stream.finish_reason is None:
                        stream.finish_reason = reason
                if budgeted or item is not None:   # None: nothing to send (e.g. logprobs nobody asked for)
                    out = outputs.get(stream.request_id)
                    if out is not None:
                        out.add(stream.name, modality, item)
                    elif deferred:   # rides with the request's next output
                        stream.owner.held.setdefault((stream.name, modality), []).append(item)
                    else:
                        self._output_for(stream.request_id, stream.owner.held).add(stream.name, modality, item)
            except Exception as exc:
                self._edge_failures.append((stream, exc))

    def _keep_value(self, streams: list[StreamState], instruction: KeepValue) -> None:
        value = instruction.value
        for stream in streams:
            try:
                stream.kept[value] = stream.env[value]
                stream.pc += 1
            except Exception as exc:
                self._edge_failures.append((stream, exc))

    def _push_to_stream(self, streams: list[StreamState], instruction: PushToStream) -> None:
        value, consumer_name = instruction.value, instruction.stream
        for stream in streams:
            stream.pc += 1
            if stream.finish_reason == FinishReason.STOP and value == stream.budgeted_value:
                continue   # a stop item is counted, never rendered downstream
            try:
                consumer = stream.owner.streams[consumer_name]
                consumer.buffer.push([stream.env[value]])
            except Exception as exc:
                self._edge_failures.append((stream, exc))
                continue
            if consumer.buffer.has_ready:   # waking it for a push that completes no chunk is a no-op
                self._wake_consumer(consumer)

    def _end_walk(self, streams: list[StreamState], instruction: EndWalk) -> list[list[StreamState]]:
        value, going_on, ended = instruction.value, [], []
        for stream in streams:
            try:
                end = stream.env[value] is not None
            except Exception as exc:
                self._edge_failures.append((stream, exc))
                continue
            if end:
                stream.pc = len(stream.walk.program)
                ended.append(stream)
            else:
                stream.pc += 1
                going_on.append(stream)
        return [group for group in (going_on, ended) if group]

    def _enter_loop(self, streams: list[StreamState], instruction: EnterLoop) -> list[list[StreamState]]:
        loop, inside, skipped = instruction.loop, [], []
        for stream in streams:
            stream.loop_counts[loop] = 0
            if stream.finish_reason is not None or stream.caps.get(loop, 1) <= 0:
                stream.pc = instruction.exit_pc
                skipped.append(stream)
            else:
                stream.pc += 1
                inside.append(stream)
        return [group for group in (inside, skipped) if group]

    def _loop_back(self, streams: list[StreamState], instruction: LoopBack) -> list[list[StreamState]]:
        loop, carry, again, done = instruction.loop, instruction.carry, [], []
        for stream in streams:
            count = stream.loop_counts[loop] + 1
            stream.loop_counts[loop] = count
            env = stream.env
            try:
                for output, target in carry:
                    env[target] = env[output]
            except Exception as exc:   # a value the body did not produce
                self._edge_failures.append((stream, exc))
                continue
            cap = stream.caps.get(loop)
            if stream.finish_reason is None and (cap is None or count < cap):
                stream.pc = instruction.body_pc
                again.append(stream)
            else:
                stream.pc += 1
                done.append(stream)
        return [group for group in (again, done) if group]

    # what each instruction other than RunNode does to a stream
    _HANDLERS = {EmitToClient: _emit_to_client, KeepValue: _keep_value, PushToStream: _push_to_stream,
                 EndWalk: _end_walk, EnterLoop: _enter_loop, LoopBack: _loop_back}

    def _start_next_walk(self, stream: StreamState) -> bool:
        view = StreamView(stream.name, stream.owner.request.inputs, stream.last_walk, stream.kept)
        if stream.buffer is not None:
            if not stream.buffer.has_ready and not stream.buffer.final_delivered:
                return False   # wait for the producer
            view.chunk = stream.buffer.pop_ready()
            view.input_closed = view.chunk is None
        call = self.model.plan(view)
        if call is None:
            stream.finish_reason = stream.finish_reason or FinishReason.STOP
            return False
        if call is WAIT:
            if stream.buffer is None or view.chunk is not None:
                raise RuntimeError(f"plan of stream {stream.name!r} waited with nothing to wait for")
            return False
        walk = self.graph.compiled[call.walk]
        missing = set(walk.inputs) - set(call.inputs)
        if missing:
            raise ValueError(f"plan started walk {call.walk!r} without input(s) {sorted(missing)}")
        stream.walk, stream.pc, stream.env, stream.loop_counts = walk, 0, dict(call.inputs), {}
        self.walk_counts[call.walk] += 1
        return True

    def _arrive_at_node(self, stream: StreamState, node: Node) -> None:
        if stream.call_inputs is None:
            stream.touched_nodes.add(node.name)
            self._begin_call(stream, node)
        self.at_node[node.name][stream.handle] = stream

    def _begin_call(self, stream: StreamState, node: Node) -> None:
        """Gather the node's inputs and let its executor prepare the call (may raise)."""
        env = stream.env
        inputs = {}
        for name in node.inputs:
            inputs[name] = env[name]
        self.executors[node.name].begin(stream, inputs)
        stream.call_inputs = inputs

    def _wake_consumer(self, consumer: StreamState) -> None:
        if consumer.walk is None and not consumer.is_finished:
            self.dirty[consumer.handle] = consumer

    # ---------------------------------------------------------------- batching

    def _form_batch(self, node: str, streams: list[StreamState]) -> list[NodeCall]:
        executor = self.executors[node]
        budget = self.config.max_num_batched_tokens
        max_batch_size, chunkable = executor.max_batch_size, executor.chunkable
        pending_work = executor.pending_work
        work, single, longer = {}, [], []
        for stream in streams:   # single-unit work (decode steps) first, each part by admission
            units = work[stream.handle] = pending_work(stream)
            (single if units <= 1 else longer).append(stream)
        single.sort(key=_ADMISSION_ORDER)
        if longer:
            longer.sort(key=_ADMISSION_ORDER)
            single.extend(longer)
        calls: list[NodeCall] = []
        for stream in single:
            if len(calls) >= max_batch_size or budget <= 0:
                break
            units = work[stream.handle]
            num = min(units, budget) if chunkable else units
            if num > budget and calls:
                continue
            if not executor.can_reserve(stream, num):
                if not executor.holds_state(stream):
                    continue   # never ran here: waits for resources; never a crash
                self._preempt_younger(node, stream, num, {call.stream.handle for call in calls})
                if not executor.can_reserve(stream, num):
                    continue
            executor.reserve(stream, num)
            calls.append(NodeCall(stream, stream.call_inputs, num))
            budget -= num
        return calls

    def _preempt_younger(self, node: str, stream: StreamState, num: int, chosen: set[int]) -> None:
        executor = self.executors[node]
        victims = sorted(
            (s for state in self.running.values() for s in state.streams.values()
             if s.order > stream.order and s.handle not in chosen and executor.holds_state(s)),
            key=lambda s: s.order, reverse=True,
        )
        for victim in victims:
            if executor.can_reserve(stream, num):
                return
            executor.preempt(victim)
            self.num_preemptions += 1
            logger.debug("preempted stream %s of %s on %s", victim.name, victim.owner.request_id, node)

    def _run_batch(self, node: str, calls: list[NodeCall]) -> None:
        executor = self.executors[node]
        self.node_batches[node] += 1
        try:
            results = executor.run(calls)
        except Exception:
            if len(calls) == 1:
                results = [self._run_alone(executor, calls[0])]
            else:   # find who failed: each call alone; the others go on
                logger.warning("batch of node %s failed; retrying its %d calls one by one", node, len(calls))
                results = [self._run_alone(executor, call) for call in calls]
        expected = self.graph.nodes[node].outputs
        expected_set = frozenset(expected)
        done: list[StreamState] = []
        for call, outputs in zip(calls, results):
            stream = call.stream
            if outputs is None or outputs is _FAILED or stream.request_id not in self.running:
                continue
            if not outputs.keys() >= expected_set:
                missing = [name for name in expected if name not in outputs]
                self._end_request(stream.owner, FinishReason.ERROR,
                                  error=f"node {node!r} returned no {missing}")
                continue
            env = stream.env
            for name in expected:
                env[name] = outputs[name]
            done.append(stream)
        self._after_calls(node, done)

    def _after_calls(self, node: str, streams: list[StreamState]) -> None:
        """These streams' calls at `node` are done: run the edges after it now. A stream
        they lead back to this node (a decode loop) starts its next call here; the others
        are left for phase 5."""
        places: dict[tuple[str, int], list[StreamState]] = {}
        for stream in streams:
            stream.call_inputs = None
            places.setdefault((stream.walk.name, stream.pc), []).append(stream)
        at_node, dirty = self.at_node[node], self.dirty
        for (_, node_pc), group in places.items():
            for stream in group:
                stream.pc = node_pc + 1
            for stream, exc in self._run_until_node(group):
                if stream.request_id in self.running:
                    self._fail_request(stream, exc, "in an edge")
            node_here = group[0].walk.program[node_pc].node
            for stream in group:
                if stream.is_finished:   # its request failed while this loop ran
                    continue
                if stream.pc == node_pc:   # looped back: it stays in at_node[node], batched next step
                    try:
                        self._begin_call(stream, node_here)
                    except Exception as exc:   # the node's prepare of the next call failed
                        self._fail_request(stream, exc, "while advancing")
                else:
                    del at_node[stream.handle]
                    dirty[stream.handle] = stream

    def _run_alone(self, executor: NodeExecutor, call: NodeCall):
        try:
            return executor.run([call])[0]
        except Exception as exc:
            self._fail_request(call.stream, exc, "in a node")
            return _FAILED

    # ---------------------------------------------------------------- endings

    def _fail_request(self, stream: StreamState, exc: Exception, where: str) -> None:
        logger.error("request %s failed %s", stream.request_id, where, exc_info=exc)
        self._end_request(stream.owner, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _finish_stream(self, stream: StreamState) -> None:
        stream.is_finished = True
        self._release(stream)
        out = self.outputs.get(stream.request_id)
        if out is not None:   # with the stream's last items: its client learns now, not when the request ends
            out.stream_finish_reasons[stream.name] = stream.finish_reason
        for consumer_name, edge in self.graph.edges_by_consumer.items():
            if edge.producer == stream.name:
                consumer = stream.owner.streams[consumer_name]
                consumer.buffer.close()
                self._wake_consumer(consumer)
        if stream.owner.is_finished:
            self._end_request(stream.owner, None)

    def _release(self, stream: StreamState) -> None:
        for node in stream.touched_nodes:
            self.executors[node].release(stream)
            self.at_node[node].pop(stream.handle, None)
        stream.touched_nodes.clear()
        self.dirty.pop(stream.handle, None)

    def _end_request(self, state: RequestState, reason: str | None, error: str | None = None) -> None:
        """Final record of a request; `reason` overrides the streams' own (abort, error)."""
        if self.running.pop(state.request_id, None) is None:
            return
        for stream in state.streams.values():
            self._release(stream)
            if not stream.is_finished:
                stream.is_finished = True
                stream.finish_reason = reason or stream.finish_reason
        out = self._output_for(state.request_id, state.held)
        out.finished = True
        out.error = error
        out.stream_finish_reasons = {name: s.finish_reason or reason for name, s in state.streams.items()}
        out.usage = {name: s.count for name, s in state.streams.items()}
        out.finish_reason = reason or self._primary_finish_reason(state)
        # Each stream points at its request and the request at its streams: a cycle only
        # the collector's oldest generation would free, with the streams' buffers and
        # pinned PCM held until then (and at 256 streams such collections take tens of ms
        # of a step). Broken here, reference counting frees a finished request at once.
        state.streams.clear()

    def _primary_finish_reason(self, state: RequestState) -> str:
        for name in self.graph.entry_streams:
            if self.graph.streams[name].budget is not None:
                return state.streams[name].finish_reason
        return state.streams[self.graph.entry_streams[0]].finish_reason

    def _output_for(self, request_id: str, held: dict | None = None) -> RequestOutput:
        """This step's output of a request; `held`: the items its deferred edges held back
        (`RequestState.held`), handed over first."""
        out = self.outputs.get(request_id)
        if out is None:
            out = self.outputs[request_id] = RequestOutput(request_id)
        if held:
            for key, items in held.items():
                out.items.setdefault(key, []).extend(items)
            held.clear()
        return out


_FAILED = object()
