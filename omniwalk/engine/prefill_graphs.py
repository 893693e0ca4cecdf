"""Ragged prefill batches captured as CUDA graphs, one per (tokens, sequences) bucket.

When a request joins a running batch, its prompt runs eagerly beside the decode graph's
rows (`CausalLMExecutor`). For a hybrid model that eager pass is hundreds of kernel
launches from Python: on the H200 a 32-token prompt joining Qwen3.5-0.8B's batch made the
step ~20 ms longer, against a decode step of 2-7 ms. Padded to a bucket, a ragged batch's
shapes depend on the bucket alone, so it can be captured once and replayed:

    bucket (64 tokens, 4 sequences):
        tokens:     [ piece a: 20 | piece b: 9 | pad: 1 | pad: 34 ]
        sequences:  [ a           | b          | pad    | pad     ]

The real pieces come first; padding sequences (at least one token each) take the rest,
with the scratch page for their keys/values and the scratch slot for their state (both
owned by no sequence, shared with the decode graphs), so what they compute lands where
nobody reads. Their context length is -1, which the attention kernel answers with zeros
and no keys read: a large bucket's last padding piece may be thousands of tokens long. As
in `DecodeGraphs`, each piece's state rows (read, write) are inputs; the executor commits
them once the step succeeded. Buckets hold pieces of at most `max_tokens` tokens in all
(`MAX_TOKENS` by default; the loader passes a step's budget, or 128 for a hybrid model, so
every piece is short and its recurrent layers take their one-launch kernel).

On a CPU nothing is captured and `run` computes the padded batch eagerly from the same
buffers, so CI runs the padding and the buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from omniwalk.engine.attention import AttentionMetadata, PagedAttention
from omniwalk.engine.cuda_graphs import BucketGraphs, DecodeGraphs
from omniwalk.engine.ragged import RaggedLengths, conv_window_indices

# 256: a 128-token prompt with its padding sequence (the text tables' c = 1 prompts) fits a
# graph; on the H200 that prompt ran eagerly in 46 ms (the Qwen3-Omni Thinker, with PDL's
# graph-only kernels) against 32 ms replayed for prompts that fit (not yet measured with 256).
# The larger buckets (`capture_prefill_graphs` goes up to --max-num-batched-tokens) hold a
# wave's prefill steps: on the H200 Qwen3-0.6B's eager pass over seven 128-token prompts
# took 22-28 ms of host time for 4 ms on the GPU; padded by at most a third.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
SEQUENCE_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512)   # padding included: up to n - 1 real pieces
MAX_TOKENS = 256          # the default largest bucket (tests; hybrid models pass fewer)
MAX_SEQUENCES = 8


class PrefillGraphs(BucketGraphs):
    def __init__(self, model: torch.nn.Module, decode_graphs: DecodeGraphs, conv_kernel: int | None = None,
                 max_tokens: int = MAX_TOKENS, max_sequences: int = MAX_SEQUENCES):
        """`decode_graphs` lends its cache, scratch page, slot resource and scratch slot;
        `conv_kernel`: the recurrent layers' conv width (hybrid models); `max_tokens` and
        `max_sequences`: the largest bucket's tokens and sequences (padding included)."""
        self.model = model
        self.cache = decode_graphs.cache
        self.device = decode_graphs.device
        self.on_cuda = decode_graphs.on_cuda
        self.scratch_page = decode_graphs.scratch_page
        self.slot_resource = decode_graphs.slot_resource
        self.scratch_row_slots = getattr(decode_graphs, "scratch_row_slots", None)
        columns = decode_graphs.slot_columns
        self.max_pages = decode_graphs.max_pages
        self.conv_kernel = conv_kernel or 1
        sequence_buckets = [n for n in SEQUENCE_BUCKETS if n <= max_sequences]
        # every sequence takes at least one token
        self.buckets = sorted((t, n) for t in TOKEN_BUCKETS if t <= max_tokens for n in sequence_buckets if n <= t)
        self.max_sequences = sequence_buckets[-1]
        tokens, seqs, kernel = max_tokens, self.max_sequences, self.conv_kernel
        # one long and one int32 buffer, staged through pinned memory in one copy each
        self._long_fields = {"input_ids": tokens, "positions": tokens, "kv_slots": tokens, "ends": seqs,
                             "row_slots": columns * seqs, "cu_seqlens": seqs + 1, "conv_gather": tokens * kernel,
                             "conv_state": seqs * (kernel - 1)}
        self._int_fields = {"query_start": seqs + 1, "context_lens": seqs, "page_table": seqs * self.max_pages}
        pinned = dict(pin_memory=self.on_cuda)
        self.host_longs = torch.zeros(sum(self._long_fields.values()), dtype=torch.long, **pinned)
        self.host_ints = torch.zeros(sum(self._int_fields.values()), dtype=torch.int32, **pinned)
        self.device_longs = torch.zeros_like(self.host_longs, device=self.device)
        self.device_ints = torch.zeros_like(self.host_ints, device=self.device)
        self._init_graphs()
        self._host_layout: tuple[list[int], list[int], list[list[int]]] | None = None   # CPU path only
        self.replays = 0   # counter for tests and the bench
        self._copied = torch.cuda.Event() if self.on_cuda else None   # the last layout copy

    # ------------------------------------------------------------ buffers

    def _field(self, buffer: torch.Tensor, fields: dict[str, int], name: str) -> torch.Tensor:
        offset = 0
        for key, size in fields.items():
            if key == name:
                return buffer[offset : offset + size]
            offset += size
        raise KeyError(name)

    def _longs(self, name: str, host: bool = False) -> torch.Tensor:
        return self._field(self.host_longs if host else self.device_longs, self._long_fields, name)

    def _ints(self, name: str, host: bool = False) -> torch.Tensor:
        return self._field(self.host_ints if host else self.device_ints, self._int_fields, name)

    # ------------------------------------------------------------ capture

    def _forward(self, bucket: tuple[int, int]) -> torch.Tensor:
        tokens, seqs = bucket
        query_lens, context_lens, page_tables = self._host_layout or (None, None, None)
        meta = AttentionMetadata(
            slot_mapping=self._longs("kv_slots")[:tokens],
            query_lens=query_lens, context_lens=context_lens, page_tables=page_tables,
            query_start=self._ints("query_start")[: seqs + 1],
            context_lens_tensor=self._ints("context_lens")[:seqs],
            page_table_tensor=self._ints("page_table").view(-1, self.max_pages)[:seqs] if self.on_cuda else None,
            max_query_len=tokens,
        )
        inputs = (self._longs("input_ids")[:tokens], self._longs("positions")[:tokens], PagedAttention(self.cache, meta))
        if self.slot_resource is not None:
            kernel = self.conv_kernel
            ragged = RaggedLengths.from_buffers(
                self._longs("cu_seqlens")[: seqs + 1],
                self._longs("conv_gather")[: tokens * kernel].view(tokens, kernel),
                self._longs("conv_state")[: seqs * (kernel - 1)].view(seqs, kernel - 1),
                max_len=tokens, lengths=query_lens)
            row_slots = self._longs("row_slots").view(-1, self.max_sequences)[:, :seqs]
            inputs += (self.slot_resource.prefill_view(row_slots, ragged),)
        hidden = self.model(*inputs)
        return self.model.compute_logits(hidden.index_select(0, self._longs("ends")[:seqs]))   # [seqs, vocab] fp32

    @torch.inference_mode()
    def capture(self) -> None:
        self._capture(prepare=self._prepare_capture)

    @torch.inference_mode()
    def run_eagerly_once(self) -> None:
        """The smallest bucket's forward outside a graph (its padding alone: nothing real written)."""
        bucket = self.buckets[0]
        self._prepare_capture(bucket)
        self._forward(bucket)

    def _prepare_capture(self, bucket) -> None:
        # a valid layout for the warm-up runs and the capture: the bucket as padding alone
        self._fill(bucket, [], [], [], [], [], [], [])
        self._copy_layout()

    # ------------------------------------------------------------ a step

    def bucket_for(self, query_lens: list[int], page_counts: list[int]) -> tuple[int, int] | None:
        """The smallest bucket that holds these pieces with at least one padding sequence."""
        if max(page_counts) > self.max_pages:
            return None
        total, count = sum(query_lens), len(query_lens)
        for tokens, seqs in self.buckets:
            if count < seqs and total + seqs - count <= tokens:
                return tokens, seqs
        return None

    def _fill(self, bucket, input_ids, positions, kv_slots, context_lens, query_lens, page_tables,
              row_slots) -> None:
        """Write the padded layout of these pieces into the pinned staging buffers."""
        tokens, seqs = bucket
        total, count = sum(query_lens), len(query_lens)
        pads = seqs - count
        pad_lens = [1] * (pads - 1) + [tokens - total - (pads - 1)]
        lengths = list(query_lens) + pad_lens
        page_size = self.cache.page_size
        scratch_kv = self.scratch_page * page_size
        longs = {name: self._longs(name, host=True).numpy() for name in self._long_fields}
        ints = {name: self._ints(name, host=True).numpy() for name in self._int_fields}
        longs["input_ids"][:total] = input_ids
        longs["input_ids"][total:tokens] = 0
        longs["positions"][:total] = positions
        longs["positions"][total:tokens] = 0
        longs["kv_slots"][:total] = kv_slots
        longs["kv_slots"][total:tokens] = scratch_kv
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        longs["ends"][:seqs] = starts[1:] - 1
        longs["cu_seqlens"][: seqs + 1] = starts
        ints["query_start"][: seqs + 1] = starts
        ints["context_lens"][:count] = context_lens
        ints["context_lens"][count:seqs] = -1   # padding: zeros out of the attention
        table = ints["page_table"].reshape(-1, self.max_pages)
        table[:seqs] = self.scratch_page
        for row, pages in enumerate(page_tables):
            table[row, : len(pages)] = pages
        if self.slot_resource is not None:
            columns = longs["row_slots"].reshape(-1, self.max_sequences)     # [slots_per_row, max sequences]
            if count:
                columns[:, :count] = np.asarray(row_slots, dtype=np.int64).reshape(count, -1).T
            columns[:, count:seqs] = np.asarray(self.scratch_row_slots, dtype=np.int64)[:, None]
            kernel = self.conv_kernel
            gather, state = conv_window_indices(lengths, kernel)
            longs["conv_gather"][: tokens * kernel] = gather.reshape(-1)
            longs["conv_state"][: seqs * (kernel - 1)] = state.reshape(-1)
        self._host_layout = None if self.on_cuda else (
            lengths, list(context_lens) + [-1] * pads,
            [list(p) for p in page_tables] + [[self.scratch_page] * -(-n // page_size) for n in pad_lens])

    def _copy_layout(self) -> None:
        self.device_longs.copy_(self.host_longs, non_blocking=self.on_cuda)
        self.device_ints.copy_(self.host_ints, non_blocking=self.on_cuda)
        if self.on_cuda:
            self._copied.record()

    def run(self, input_ids: list[int], positions: list[int], kv_slots: list[int], context_lens: list[int],
            query_lens: list[int], page_tables: list[list[int]],
            row_slots: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """Logits [len(query_lens), vocab] at each piece's last token. The pieces must fit a
        bucket (`bucket_for`)."""
        bucket = self.bucket_for(query_lens, [len(p) for p in page_tables])
        if self.on_cuda:
            # the staging buffers are reused: the last copy out of them must be done (a step
            # of prefill chunks alone samples nothing, so nothing else waited for it)
            self._copied.synchronize()
        self._fill(bucket, input_ids, positions, kv_slots, context_lens, query_lens, page_tables, row_slots)
        self._copy_layout()
        self.replays += 1
        return self._replay(bucket, len(query_lens))
