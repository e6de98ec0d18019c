"""Small host lists onto the device without waiting for it.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which makes the
host wait until the stream has drained: the rank would then sit idle for the step queued
ahead instead of preparing the next one. Copies from pinned memory go on the stream instead
(PyTorch's caching host allocator keeps the pinned block until the copy has read it).
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, queued behind the stream's work (CUDA) or made now."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)
