"""Small host values (per-row parameters, ids) onto the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes
the stream: the host waits for every kernel queued before it. In a look-ahead step the
sampler's inputs are built right after the next forward was queued, so such a copy would
make the host wait for that whole forward. Staged through pinned memory, the copy is
queued like a kernel and the host goes on.
"""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)`, asynchronous on CUDA."""
    host = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
