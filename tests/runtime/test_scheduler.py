"""The runtime's scheduler against a fake paged executor: no model, no timing.

`PagedLM` stands for a causal LM's node: its resources are a pool of pages of a few
tokens each, a call's work is the tokens of its context not yet computed (a prompt, a
decode step's token, or everything again after a preemption), and its output is a
function of the whole context, so a recomputed stream produces the same items. It
checks the scheduler's side of the contract as it goes (nothing is reserved past the
pool, a call runs only tokens it reserved and had pending) and records every batch and
preemption for the tests to read.

What is pinned (runtime.py's docstring and `Runtime._form_batch`): a stream that cannot
reserve and holds nothing waits, without preempting; a running stream that cannot grow
preempts the youngest stream holding pages that is not already in the batch; a batch
takes decode rows first, then by admission order, chunking prefills so that its work
never exceeds `max_num_batched_tokens`; `add_request` past `max_queue` waiting requests
raises QueueFullError and changes nothing.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest

from toy_models import ToyDecoder

from omniwalk.runtime import (
    NodeCall, NodeExecutor, QueueFullError, Request, Runtime, SchedulerConfig, StreamParams,
)



def next_token(context: list[int]) -> int:
    """The fake model: the next token depends on the whole context."""
    return zlib.crc32(repr(context).encode()) % 1000


@dataclass
class Sequence:
    request_id: str
    order: int
    context: list[int] = field(default_factory=list)   # the tokens the node was given
    computed: int = 0                                  # of them, how many hold pages ("KV") now
    pages: int = 0


class Call(NamedTuple):
    request_id: str
    tokens: int       # scheduled this step
    pending: int      # the call's work left before this step
    done: bool        # its last token computed: it produced an output


class PagedLM(NodeExecutor):
    def __init__(self, num_pages: int, page_size: int, chunkable: bool = True):
        self.num_pages, self.page_size, self.chunkable = num_pages, page_size, chunkable
        self.free = num_pages
        self.sequences: dict[int, Sequence] = {}
        self.batches: list[list[Call]] = []
        self.available: list[int] = []                    # per batch: pending tokens at the node before it
        self.preemptions: list[tuple[str, str]] = []      # (the stream that needed pages, its victim)
        self.computed_tokens: dict[str, int] = {}         # request id -> tokens computed, recomputation included
        self.peak = 0
        self._asking: Sequence | None = None               # the last stream can_reserve was asked about
        self._in_batch: set[int] = set()                  # reserved for the batch being formed

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def begin(self, stream, inputs) -> None:
        sequence = self.sequences.setdefault(stream.handle, Sequence(stream.request_id, stream.order))
        x = inputs["x"]
        sequence.context.extend(x if isinstance(x, tuple) else [x])   # a prompt, or the token decoded last

    def pending_work(self, stream) -> int:
        sequence = self.sequences[stream.handle]
        return len(sequence.context) - sequence.computed

    def can_reserve(self, stream, num_tokens: int) -> bool:
        sequence = self._asking = self.sequences[stream.handle]
        return self.pages_for(sequence.computed + num_tokens) - sequence.pages <= self.free

    def reserve(self, stream, num_tokens: int) -> None:
        sequence = self.sequences[stream.handle]
        need = max(0, self.pages_for(sequence.computed + num_tokens) - sequence.pages)
        assert need <= self.free, f"{sequence.request_id} reserved {need} pages with {self.free} free"
        self.free -= need
        sequence.pages += need
        self.peak = max(self.peak, self.num_pages - self.free)
        self._in_batch.add(stream.handle)

    def run(self, calls: list[NodeCall]) -> list[dict | None]:
        self.available.append(sum(len(s.context) - s.computed for s in self.sequences.values()))
        batch, outputs = [], []
        for call in calls:
            sequence = self.sequences[call.stream.handle]
            assert 0 < call.num_tokens <= len(sequence.context) - sequence.computed
            assert self.pages_for(sequence.computed + call.num_tokens) <= sequence.pages, "ran unreserved tokens"
            sequence.computed += call.num_tokens
            rid = sequence.request_id
            self.computed_tokens[rid] = self.computed_tokens.get(rid, 0) + call.num_tokens
            done = sequence.computed == len(sequence.context)
            batch.append(Call(rid, call.num_tokens, len(sequence.context) - sequence.computed + call.num_tokens, done))
            outputs.append({"tok": next_token(sequence.context)} if done else None)
        self.batches.append(batch)
        self._in_batch.clear()
        return outputs

    def holds_state(self, stream) -> bool:
        sequence = self.sequences.get(stream.handle)
        return sequence is not None and sequence.pages > 0

    def preempt(self, stream) -> None:
        victim, asking = self.sequences[stream.handle], self._asking
        # the youngest stream holding pages outside the batch, and younger than the one asking
        candidates = [s for handle, s in self.sequences.items() if s.pages and handle not in self._in_batch]
        assert victim.order == max(s.order for s in candidates), "not the youngest holder preempted"
        assert victim.order > asking.order, "an older stream preempted for a younger one"
        self.preemptions.append((asking.request_id, victim.request_id))
        self.free += victim.pages
        victim.pages, victim.computed = 0, 0   # recomputed from its first token when it runs again

    def release(self, stream) -> None:
        sequence = self.sequences.pop(stream.handle, None)
        if sequence is not None:
            self.free += sequence.pages


def request(rid: str, prompt_len: int, budget: int) -> Request:
    prompt = tuple(zlib.crc32(f"{rid}{i}".encode()) % 1000 for i in range(prompt_len))
    return Request(rid, prompt, {"main": StreamParams(budget)})


@dataclass
class Run:
    items: dict[str, list[int]] = field(default_factory=dict)
    finals: dict = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)   # request id -> step of its first item
    final_step: dict[str, int] = field(default_factory=dict)
    steps: int = 0


def drive(runtime: Runtime, result: Run | None = None, steps: int | None = None, until=None) -> Run:
    """Step until nothing is left (or `until(result)`, or `steps` steps), collecting items and
    final records."""
    result = result or Run()
    for _ in range(steps or 500):
        if not runtime.has_unfinished or (until is not None and until(result)):
            return result
        step, result.steps = result.steps, result.steps + 1
        for out in runtime.step():
            items = out.items.get(("main", "main"), [])
            if items:
                result.first_step.setdefault(out.request_id, step)
            result.items.setdefault(out.request_id, []).extend(items)
            if out.finished:
                assert out.request_id not in result.finals, "two final records"
                result.finals[out.request_id] = out
                result.final_step[out.request_id] = step
    if steps is not None:
        return result
    raise AssertionError("not done after 500 steps")


def reference(requests: list[Request]) -> dict[str, list[int]]:
    """Each request's items with room for everything: no waiting, chunking or preemption."""
    runtime = Runtime(ToyDecoder(PagedLM(10_000, 4)), SchedulerConfig(max_num_batched_tokens=100_000))
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime)
    assert runtime.num_preemptions == 0
    return run.items


def assert_all_finished_in_full(run: Run, requests: list[Request], executor: PagedLM) -> None:
    expected = reference(requests)
    assert run.items == expected
    for r in requests:
        final, budget = run.finals[r.request_id], r.streams["main"].max_items
        assert (final.finish_reason, final.usage, len(run.items[r.request_id])) == ("length", {"main": budget}, budget)
    assert executor.free == executor.num_pages and not executor.sequences   # every page came back


# ---------------------------------------------------------------- (a) a stream that cannot reserve waits


def test_a_stream_that_cannot_reserve_waits_without_preempting_and_runs_once_pages_free():
    executor = PagedLM(num_pages=5, page_size=4)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8))
    # a: 12 prompt tokens (3 pages), then 3 decode inputs: a 4th page; b: 12 prompt tokens,
    # 3 pages, while 2 are free; c: 3 prompt tokens, 1 page: it fits, and runs past b
    requests = [request("a", 12, 4), request("b", 12, 3), request("c", 3, 2)]
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime)
    # b holds nothing: it only waits, preempting nobody
    assert executor.preemptions == [] and runtime.num_preemptions == 0
    assert [[call.request_id for call in batch] for batch in executor.batches] == \
        [["a", "c"], ["a", "c"], ["a"], ["a"], ["b"], ["b"], ["b"]]
    assert run.final_step["a"] == 3 and run.first_step["b"] == 4          # b starts the step after a ends
    assert executor.peak == 5
    assert_all_finished_in_full(run, requests, executor)


def test_a_waiting_stream_takes_no_pages_from_a_younger_stalled_one():
    executor = PagedLM(num_pages=3, page_size=4)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8))
    # a: 4 prompt tokens, then 2 pages; b: an 8-token prompt, 2 pages; c, the youngest: a
    # 1-token prompt (a decode-sized call) that needs its 2nd page in step 4, while a holds 2
    requests = [request("a", 4, 5), request("b", 8, 2), request("c", 1, 6)]
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime)
    # in step 4 c cannot grow (a is older) and b cannot start: neither takes c's page
    assert executor.preemptions == []
    assert [[call.request_id for call in batch] for batch in executor.batches] == \
        [["c", "a"]] + [["a", "c"]] * 3 + [["a"], ["c"], ["c"], ["b"], ["b"]]
    assert run.final_step["c"] < run.first_step["b"]
    assert_all_finished_in_full(run, requests, executor)


def test_waiting_streams_are_taken_in_admission_order_as_pages_free():
    executor = PagedLM(num_pages=3, page_size=4)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8))
    # each needs 3 pages at its end (8 prompt tokens + 3 decode inputs): one at a time, oldest first
    requests = [request(rid, 8, 4) for rid in ("a", "b", "c")]
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime)
    assert run.first_step["a"] < run.final_step["a"] < run.first_step["b"] < run.final_step["b"] < run.first_step["c"]
    assert executor.preemptions == []
    assert_all_finished_in_full(run, requests, executor)


# ---------------------------------------------------------------- (b) preemption when the pool runs out mid-decode


def test_the_pool_running_out_mid_decode_preempts_the_youngest_and_it_resumes_in_full():
    executor = PagedLM(num_pages=6, page_size=4)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8))
    # 4 prompt tokens (1 page) each: the prefills and the first decode steps fit (2 pages
    # each); the 9th token needs a third page, and the pool has none: a takes c's
    requests = [request(rid, 4, 9) for rid in ("a", "b", "c")]
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime)
    assert executor.preemptions == [("a", "c")] and runtime.num_preemptions == 1
    assert run.final_step["c"] > max(run.final_step["a"], run.final_step["b"])   # it waited for their pages
    # c's 8 context tokens (4 prompt, 4 decoded) were computed twice: its work was redone
    assert executor.computed_tokens == {"a": 12, "b": 12, "c": 12 + 8}
    assert_all_finished_in_full(run, requests, executor)


def test_preemption_takes_the_youngest_first_and_never_for_a_younger_stream():
    executor = PagedLM(num_pages=7, page_size=2)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6))
    # five streams of 2 prompt tokens grow a page every other step, past what 7 pages hold;
    # the prefills are chunked into 6-token batches, so some start a step after the others
    requests = [request(rid, 2, 8) for rid in ("a", "b", "c", "d", "e")]
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime)
    # PagedLM.preempt checked each victim: the youngest holder outside the batch, younger than the asker
    assert len(executor.preemptions) == runtime.num_preemptions >= 3
    assert "a" not in {victim for _, victim in executor.preemptions}
    # so the oldest never waits: one item a step from its first to its last
    assert run.final_step["a"] - run.first_step["a"] == len(run.items["a"]) - 1
    assert_all_finished_in_full(run, requests, executor)


def test_a_younger_stream_never_preempts_an_older_one_mid_prefill():
    executor = PagedLM(num_pages=3, page_size=4)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8))
    runtime.add_request(request("z", 7, 2))
    run = drive(runtime, steps=1)   # z holds 2 of the 3 pages
    requests = [request("o", 12, 1), request("y", 3, 8)]
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime, run)
    # step 1: o's first chunk (7 tokens, 2 pages) does not fit and it waits; y's prompt takes
    # the last page. Step 2: z is gone, o takes 2 pages for its next 7 tokens. Step 3: y's
    # decode needs a page: o is older, y only waits; o's last 5 tokens need one: it takes y's
    assert executor.preemptions == [("o", "y")] and runtime.num_preemptions == 1
    assert [[(call.request_id, call.tokens) for call in batch] for batch in executor.batches][1:4] == \
        [[("z", 1), ("y", 3)], [("y", 1), ("o", 7)], [("o", 5)]]
    assert_all_finished_in_full(run, [request("z", 7, 2)] + requests, executor)


# ---------------------------------------------------------------- (c) the per-step token budget


@pytest.mark.parametrize("budget", [1, 5, 8])
def test_batches_fill_the_token_budget_with_decode_rows_first_and_chunked_prefills(budget):
    executor = PagedLM(num_pages=1000, page_size=4)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))
    requests = [request("long", 20, 5), request("short", 3, 6), request("mid", 13, 2)]
    for r in requests[:2]:
        runtime.add_request(r)
    run = drive(runtime, until=lambda run: "short" in run.items)   # "mid" arrives while the others decode
    runtime.add_request(requests[2])
    run = drive(runtime, run)
    for batch, available in zip(executor.batches, executor.available):
        tokens = [call.tokens for call in batch]
        # never over the budget, and never under it while work waits (the pool has room for all)
        assert sum(tokens) == min(budget, available)
        # decode rows (one pending token) come first, each counted as one token
        rows = sum(1 for call in batch if call.pending == 1)
        assert all(call.pending == 1 and call.tokens == 1 for call in batch[:rows])
        # only the last call may be cut, to what the budget has left
        assert all(call.tokens == call.pending for call in batch[:-1])
    for r in requests:   # each prompt ran in budget-sized chunks; only the last produced an item
        calls = [call for batch in executor.batches for call in batch if call.request_id == r.request_id]
        prefill = calls[:next(i for i, call in enumerate(calls) if call.done) + 1]
        assert sum(call.tokens for call in prefill) == len(r.inputs)
        assert len(prefill) >= -(-len(r.inputs) // budget)
        if r.request_id == "long":   # the oldest: each chunk takes the whole budget
            assert [call.tokens for call in prefill[:-1]] == [budget] * (len(prefill) - 1)
            assert len(prefill) == -(-20 // budget)
    if budget > 1:   # "mid" arrived while the others decoded: its chunks rode along with their rows
        assert any({call.pending == 1 for call in batch} == {True, False} for batch in executor.batches)
    assert_all_finished_in_full(run, requests, executor)


def test_a_non_chunkable_call_over_the_budget_runs_alone():
    executor = PagedLM(num_pages=1000, page_size=4, chunkable=False)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6))
    requests = [request("small", 3, 3), request("big", 10, 2)]
    for r in requests:
        runtime.add_request(r)
    run = drive(runtime)
    for batch in executor.batches:
        tokens = [call.tokens for call in batch]
        assert sum(tokens) <= 6 or tokens == [10]   # the over-budget prefill, whole and alone
    assert [("big", 10)] in [[call[:2] for call in batch] for batch in executor.batches]
    assert_all_finished_in_full(run, requests, executor)


# ---------------------------------------------------------------- (d) max_queue


def test_max_queue_rejects_past_the_waiting_limit_and_loses_nothing_admitted():
    executor = PagedLM(num_pages=1000, page_size=4)
    runtime = Runtime(ToyDecoder(executor), SchedulerConfig(max_num_seqs=2, max_queue=3))
    admitted = [request(f"r{i}", 3 + i, 4 + i) for i in range(3)]
    for r in admitted:
        runtime.add_request(r)
    with pytest.raises(QueueFullError):   # 3 waiting: the queue is full before any step
        runtime.add_request(request("rejected", 2, 2))
    assert list(runtime.waiting) == ["r0", "r1", "r2"] and runtime.abort("rejected") is False
    run = drive(runtime, steps=1)         # r0 and r1 are admitted: two places in the queue again
    assert sorted(runtime.running) == ["r0", "r1"] and list(runtime.waiting) == ["r2"]
    more = [request("r3", 5, 3), request("r4", 2, 5)]
    for r in more:
        runtime.add_request(r)
    with pytest.raises(QueueFullError):
        runtime.add_request(request("rejected", 2, 2))
    assert runtime.abort("r4") is True    # a waiting request aborted frees its place
    runtime.add_request(request("rejected", 2, 2))   # the id was never taken
    run = drive(runtime, run)
    everything = admitted + [more[0], request("rejected", 2, 2)]
    assert run.finals["r4"].finish_reason == "abort" and run.items.get("r4", []) == []
    del run.items["r4"], run.finals["r4"]
    assert sorted(run.finals) == sorted(r.request_id for r in everything)
    assert_all_finished_in_full(run, everything, executor)


def test_scheduler_config_rejects_a_zero_limit():
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_queue"):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: 0})
