"""Where a forward pass reads and writes one layer's per-sequence states.

A recurrent layer's states live in a pool tensor [rows, *state_shape] (the engine's
`StatePool`). A pass reads sequence i's state from row `read[i]` and writes its state
after the pass to row `write[i]`, a different row that nobody reads during the pass:

    pool rows:   [ s0 | s0' | s1 | s1' | ... ]
    read  = [0, 2]      the states before the pass (committed)
    write = [1, 3]      the states after it (committed only once the step succeeded)

So kernels update states in place, with no gathered copies and no copy back, and a pass
that fails leaves every committed state as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateRows:
    pool: torch.Tensor    # [rows, *state_shape]: one recurrent layer's states
    read: torch.Tensor    # [sequences] int64: each sequence's state before the pass
    write: torch.Tensor   # [sequences] int64: where its state after the pass goes

    def gather(self) -> torch.Tensor:
        """Copies of the states before the pass [sequences, *state_shape] (torch paths)."""
        return self.pool.index_select(0, self.read)

    def scatter(self, states: torch.Tensor) -> None:
        """Write the states after the pass [sequences, *state_shape]."""
        self.pool.index_copy_(0, self.write, states.to(self.pool.dtype))
