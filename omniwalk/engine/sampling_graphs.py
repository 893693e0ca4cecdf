"""The sampling of a decode-graph step, replayed as one CUDA graph.

Eager sampling of 256 rows is ~25 small kernels and their Python (penalties, temperature,
the top-k / top-p sort, the race, a model's candidate columns): ~1.5 ms of host time a
step. At short contexts a decode step is host-bound (every request's first ~28 steps at
256 speech streams: its time to first audio), so that time is the step's. Here
`sample_rows` over the decode graph's static logits is captured once per

    (SamplingPlan, column count, candidate table, seen-id mask) x batch bucket

(every bucket at the plan's first step), and a step costs one replay after the decode graph's:

    per batch (when its rows change):  each row's values (temperature, top-k, top-p, min-p,
                                        repetition penalty, greedy), neutral in padded rows;
                                        its rows of the seen-id mask
    per step, one copy:                 [key low; key high; candidate table row] per row

Padded rows (n .. bucket-1) sample from the decode graph's padded logits with neutral
values; their ids are dropped. The ids equal `Sampler`'s: `sample_rows` calls the same
stage functions with the same values (tests: on the CPU, where nothing is captured and
the same function runs eagerly; on the GPU, graph against eager sampling).

Outside any plan, and sampled eagerly: logprobs, presence / frequency penalties (their
counts live on the host), rows still under min_tokens, a logits mask without a candidate
table, and steps whose logits are not a decode graph's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs, capture_per_bucket
from omniwalk.engine.sampler import RowSettings, RowValues, SamplingPlan, sample_rows

logger = logging.getLogger(__name__)

# the rows of the staging buffer: each batch row's stage values, then its per-step inputs
_ROW_OF = {name: index for index, name in enumerate(RowValues.DTYPES)}
_KEY_LOW, _KEY_HIGH, _TABLE_ROW = range(len(_ROW_OF), len(_ROW_OF) + 3)
_NEUTRAL = {"temperature": 1.0, "top_k_active": 0.0, "top_p": 1.0, "top_p_active": 0.0,
            "log_min_p": -float("inf"), "repetition_penalty": 1.0, "greedy": 1.0}   # top_k: the column count


@dataclass(frozen=True)
class CandidateTable:
    """A model's sampling columns (`LogitsMask.candidate_table`): row r of `ids` [K, C] is
    a set of vocabulary ids a step may sample from, `allowed` [K, C] which of them it may
    pick now; logits column j scores id `first + j`.

    `ids` None: every logits column is a candidate (`allowed` [K, columns] masks the
    logits in place of a gather; Whisper's suppressed tokens): the logits must score the
    whole vocabulary (`first` 0)."""

    ids: torch.Tensor | None
    allowed: torch.Tensor
    first: int = 0

    @property
    def columns(self) -> int:
        """The columns a row samples from."""
        return self.allowed.shape[1]

    @property
    def key(self) -> int:
        """What tells this table's tensors apart (a sampling graph reads them where they are)."""
        return (self.ids if self.ids is not None else self.allowed).data_ptr()

    def columns_of(self, logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of each row's candidates, disallowed ones at -inf; their ids, None if
        they are the logits' own columns), [B, C] each."""
        if self.ids is None:
            return logits.masked_fill(~self.allowed.index_select(0, rows), float("-inf")), None
        ids = self.ids.index_select(0, rows)
        picked = logits.gather(1, ids - self.first if self.first else ids)
        return picked.masked_fill_(~self.allowed.index_select(0, rows), float("-inf")), ids


class SamplingGraphs:
    """Sampling graphs over one `DecodeGraphs`' outputs (see the module docstring)."""

    def __init__(self, decode_graphs: DecodeGraphs):
        self.decode_graphs = decode_graphs
        self.device = decode_graphs.device
        self.on_cuda = self.device.type == "cuda"
        size = decode_graphs.max_batch_size
        # float64 holds every value exactly (keys are 32-bit halves); one copy a step. Two
        # pinned buffers used in turn, as DecodeGraphs' staging (a step is staged while the
        # one before may still wait for its copy), each remembering whose values it holds.
        self.host_rows = [torch.zeros(_TABLE_ROW + 1, size, dtype=torch.float64, pin_memory=self.on_cuda)
                          for _ in range(2)]
        self._values_for: list[tuple | None] = [None, None]   # (RowSettings, columns) in each buffer
        self._next_host_rows = 0
        self.rows = torch.zeros(_TABLE_ROW + 1, size, dtype=torch.float64, device=self.device)
        self.seen_rows = torch.zeros(size, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple, dict | None] = {}   # plan's key -> bucket -> (graph, output)
        self._pool = None
        self._seen_rows_for: torch.Tensor | None = None
        self.steps_sampled = 0   # for tests and the bench

    def sample(self, logits: torch.Tensor, settings: RowSettings, keys: np.ndarray,
               table: CandidateTable | None = None, table_rows: list[int] | None = None,
               seen: torch.Tensor | None = None, seen_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Token ids [n] (on the device) of the decode graph's last step, whose logits are
        `logits` [n, columns]: its output's first n rows. `keys`: each row's 64-bit key
        (`row_keys`); `table` and `table_rows`: the candidate table and each row's row of
        it; `seen` and `seen_rows`: the seen-id mask and each row's row of it (read if the
        plan has the repetition penalty). None: no graph could be captured for this plan
        (the caller samples eagerly)."""
        n, columns = logits.shape
        bucket = self.decode_graphs.bucket_for(n)
        self.steps_sampled += 1
        sampled_columns = table.columns if table is not None else columns
        plan = settings.plan(sampled_columns)
        index = self._next_host_rows
        self._next_host_rows ^= 1
        host_rows = self.host_rows[index]
        host = host_rows.numpy()
        # rows past n hold neutral values, not a bigger batch's: any bucket's graph (a capture
        # warms every bucket up) reads valid values and indices
        if self._values_for[index] != (settings, sampled_columns):
            for name, values in settings.values(sampled_columns).items():
                host[_ROW_OF[name], :n] = values
                host[_ROW_OF[name], n:] = _NEUTRAL.get(name, sampled_columns)
            self._values_for[index] = (settings, sampled_columns)
        keys = np.asarray(keys, dtype=np.uint64)
        host[_KEY_LOW, :n] = keys & np.uint64(0xFFFFFFFF)
        host[_KEY_HIGH, :n] = keys >> np.uint64(32)
        host[_TABLE_ROW, :n] = table_rows if table is not None else 0
        host[_KEY_LOW:, n:] = 0
        # the whole buffer (a few KiB) in one copy; the bucket reads its first columns
        self.rows.copy_(host_rows, non_blocking=self.on_cuda)
        if plan.repetition and seen_rows is not self._seen_rows_for:
            self.seen_rows[:n].copy_(seen_rows)
            self.seen_rows[n:].zero_()   # the empty row
            self._seen_rows_for = seen_rows
        if not self.on_cuda:   # nothing captured: the same function, eagerly, on the n rows
            return self._sample(n, plan, logits, table, seen)
        if logits.data_ptr() != self.decode_graphs.graphs[bucket][1].data_ptr():
            raise ValueError("sampling graphs read a decode graph's output: these logits are not one")
        key = (plan, columns, table.key if table is not None else None,
               seen.data_ptr() if plan.repetition else None)
        if key not in self.graphs:
            self.graphs[key] = self._capture(plan, table, seen)
        if self.graphs[key] is None:
            return None
        graph, output = self.graphs[key][bucket]
        graph.replay()
        # a copy: the next replay of any of these graphs (one memory pool) may reuse the output's memory
        return output[:n].clone()

    def _sample(self, rows: int, plan: SamplingPlan, logits: torch.Tensor, table: CandidateTable | None,
                seen: torch.Tensor | None) -> torch.Tensor:
        """What a graph holds: the first `rows` rows from the static buffers through `sample_rows`."""
        staged = self.rows[:, :rows]
        values = RowValues(**{name: staged[_ROW_OF[name]].to(dtype).unsqueeze(1)
                              for name, dtype in RowValues.DTYPES.items()})
        candidate_ids = None
        if table is not None:
            logits, candidate_ids = table.columns_of(logits, staged[_TABLE_ROW].to(torch.long))
        seen_columns = None
        if plan.repetition:
            seen_columns = seen.index_select(0, self.seen_rows[:rows])
            if candidate_ids is not None:
                seen_columns = seen_columns.gather(1, candidate_ids)
        return sample_rows(logits, plan, values, staged[_KEY_LOW].to(torch.long), staged[_KEY_HIGH].to(torch.long),
                           candidate_ids, seen_columns)

    def _capture(self, plan: SamplingPlan, table: CandidateTable | None, seen: torch.Tensor | None) -> dict | None:
        """Every bucket's graph of this plan, at its first step: one pause (each capture
        synchronizes and empties the allocator's cache), not one whenever a batch size is new."""
        started = time.perf_counter()
        decode = self.decode_graphs
        try:
            graphs = capture_per_bucket(self.device, decode.buckets,
                                        lambda b: self._sample(b, plan, decode.graphs[b][1], table, seen), pool=self._pool)
        except Exception:   # eager sampling does the same work, with more launches
            logger.exception("could not capture the sampling graphs of %s; those steps sample eagerly", plan)
            return None
        self._pool = graphs[decode.buckets[0]][0].pool()
        logger.info("captured sampling graphs (%s) for batch sizes %s in %.2f s", plan, decode.buckets,
                    time.perf_counter() - started)
        return graphs
