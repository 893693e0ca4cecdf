"""The Talker's decode steps (one new row per sequence) as CUDA graphs.

`DecodeGraphs` with the step's input rows (embeddings: the last frame's plus the step's
text) in a static buffer where a language model takes token ids, and the final hidden
state kept beside the codec head's logits: the code predictor reads it. The paged cache,
positions, slots and page tables are staged as for any decode step. On a CPU nothing is
captured and a step runs the same function on the same buffers, so CI runs it.
"""

from __future__ import annotations

import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.models.qwen3_omni.talker import Talker

#: the longest Talker sequence a graph step takes (prompt rows plus frames); longer ones step eagerly
MAX_GRAPH_ROWS = 16384


class TalkerDecodeGraphs(DecodeGraphs):
    def __init__(self, talker: Talker, cache: PagedKVCache, max_batch_size: int, dtype: torch.dtype):
        super().__init__(talker, cache, max_batch_size, -(-MAX_GRAPH_ROWS // cache.page_size))
        hidden = talker.config.text.hidden_size
        self.rows = torch.zeros(self.max_batch_size, hidden, dtype=dtype, device=self.device)
        self.hidden = torch.zeros(self.max_batch_size, hidden, dtype=dtype, device=self.device)

    def _forward(self, batch: int) -> torch.Tensor:
        hidden = self.model(self.rows[:batch], self.positions[:batch], self._attention(batch))
        self.hidden[:batch].copy_(hidden)
        return self.model.compute_logits(hidden)   # [batch, codec vocab] fp32

    def step(self, rows: torch.Tensor, positions: list[int],
             page_tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [n, vocab], hidden [n, hidden]) of one decode step: row i of `rows` [n, hidden]
        at cache position positions[i] of the sequence whose pages are page_tables[i]. Both
        are the graphs' buffers: read them before the next step."""
        n, size = len(positions), self.cache.page_size
        batch = self.bucket_for(n)
        self.rows[:n].copy_(rows)
        self.rows[n:batch].zero_()
        slots = [table[p // size] * size + p % size for table, p in zip(page_tables, positions)]
        logits = self.run([0] * n, positions, slots, positions, page_tables)
        return logits, self.hidden[:n]
