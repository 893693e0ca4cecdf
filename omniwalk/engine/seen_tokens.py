"""Which ids each sequence has seen (prompt and outputs), kept on the device for the
repetition penalty.

Built from the host histories at every step, the penalty's mask costs O(prompt + outputs)
host work per row: at 256 rows of ~700 ids, ~180k ids concatenated, filtered and copied
each step (3.3 ms of host time on a 2-core machine), growing with every token. Here a
sequence owns a row of one [rows, vocab] bool mask on the device, filled from its history
once; after that each token the executor appends to its history sets one bit, queued on
the host and written in one indexed store before the next sampling:

    mask row 0:   all False          (rows without a history read it)
    mask row r:   prompt ids | output ids so far      (handle -> r)

The sampler's results are the same as from the histories: the mask holds exactly the
ids of prompt + outputs, the tokens appended so far included (a look-ahead step samples
after its input token was appended, as it does with the histories).
"""

from __future__ import annotations

import numpy as np
import torch

from omniwalk.engine.host_to_device import to_device


class SeenTokens:
    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int = 64):
        self.vocab_size = vocab_size
        self.mask = torch.zeros((capacity + 1, vocab_size), dtype=torch.bool, device=device)
        self.row_of: dict[int, int] = {}
        self._free = list(range(capacity, 0, -1))     # row 0 is the empty row
        self._pending_rows: list[int] = []            # (row, id) pairs not yet on the device
        self._pending_ids: list[int] = []
        # the last `gather`'s handles list (held, so its identity is not reused) and its rows
        self._rows_of_handles: list[int] | None = None
        self._rows: torch.Tensor | None = None

    def append(self, handle: int, token: int) -> None:
        """`handle`'s history got `token` (ignored for handles without a row yet: their row
        is filled from the whole history when it is made)."""
        row = self.row_of.get(handle)
        if row is not None and 0 <= token < self.vocab_size:
            self._pending_rows.append(row)
            self._pending_ids.append(token)

    def gather(self, handles: list[int], histories: list) -> torch.Tensor:
        """[len(handles), vocab] bool: each row's seen ids (`histories[i]`: its
        `TokenHistory`, or None for a row without penalties, which reads the empty row)."""
        rows = self.rows(handles, histories)   # first: it may grow the mask
        return self.mask.index_select(0, rows)

    @torch.inference_mode()   # the mask is an inference tensor: every update runs in the mode
    def rows(self, handles: list[int], histories: list) -> torch.Tensor:
        """[len(handles)] int64 on the device: each handle's row of `mask`, every queued id
        written. Called again with the same `handles` list object (and the same
        histories), the rows are not looked up again: pass a new list when the batch changes."""
        if handles is not self._rows_of_handles:   # a batch keeps its handles list while its rows stay
            rows = []
            for handle, history in zip(handles, histories):
                if history is not None and handle not in self.row_of:
                    self._start(handle, history)
                rows.append(self.row_of.get(handle, 0) if history is not None else 0)
            self._rows_of_handles, self._rows = handles, to_device(rows, torch.long, self.mask.device)
        self._flush()
        return self._rows

    @torch.inference_mode()
    def mark(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Sets each row's bit of its token on the device, for samples the host has not seen
        yet (a look-ahead step launched before the step feeding it was copied back); the
        host appends them later, which sets the same bits again. `rows` from `rows()`;
        row 0 (no history) is written False, so it stays empty."""
        flat = rows * self.vocab_size + tokens
        self.mask.view(-1).index_put_((flat,), rows > 0)

    @torch.inference_mode()
    def free(self, handle: int) -> None:
        row = self.row_of.pop(handle, None)
        if row is not None:
            self._flush()        # nothing queued for the old owner lands in the next one's row
            self._free.append(row)
            self._rows_of_handles = None   # a cached row list may name the freed row

    def _start(self, handle: int, history) -> None:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.row_of[handle] = row
        self.mask[row].zero_()
        ids = np.concatenate([history.prompt, history.outputs]).astype(np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)].tolist()
        self._pending_rows.extend([row] * len(ids))
        self._pending_ids.extend(ids)

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        flat = np.asarray(self._pending_rows, dtype=np.int64) * self.vocab_size + self._pending_ids
        self._pending_rows, self._pending_ids = [], []
        # index_fill_ takes the value as a kernel argument; `mask[rows, ids] = True` would
        # copy a host scalar tensor to the device and wait for the whole queue (7 ms a step)
        self.mask.view(-1).index_fill_(0, to_device(flat, torch.long, self.mask.device), True)

    def _grow(self) -> None:
        rows = self.mask.shape[0]
        grown = torch.zeros((2 * rows - 1, self.vocab_size), dtype=torch.bool, device=self.mask.device)
        grown[:rows] = self.mask
        self.mask = grown
        self._free = list(range(2 * rows - 2, rows - 1, -1))
