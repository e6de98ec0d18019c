"""A token mask applied to logits: the packed bits llguidance fills (a row of int32 words per
request, bit t set where token t may come next) as -inf on every other token's logit."""

from __future__ import annotations

import numpy as np
import torch


def apply_masks(work: torch.Tensor, rows: torch.Tensor, masks: np.ndarray) -> None:
    """`work[rows]` at -inf wherever `masks` (GuideMatchers.masks' rows, in the order of
    `rows`) has no bit set. On CUDA the packed words go up (an eighth of the bytes) and are
    unpacked there; on the CPU numpy unpacks them (a tenth of torch's time there)."""
    vocab = work.shape[1]
    if work.device.type == "cuda":  # pinned: queued on the stream (engine/rank/transfer.py)
        packed = torch.from_numpy(masks).pin_memory().to(work.device, non_blocking=True)
        shifts = torch.arange(8, dtype=torch.uint8, device=work.device)
        bits = (packed.view(torch.uint8).unsqueeze(-1) >> shifts) & 1
        allowed = bits.bool().view(masks.shape[0], -1)[:, :vocab]
    else:
        bits = np.unpackbits(masks.view(np.uint8), axis=1, count=vocab, bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_))
    work[rows] = work[rows].masked_fill(~allowed, float("-inf"))


__all__ = ["apply_masks"]
