"""Embedding rows by token id, where a token of -1 takes its slot's last sample.

The engine queues decode step N+1 before the host has read step N's samples, so such a step's
tokens are -1 and its rows read `last_tokens[slot]`, which the sampler wrote on the device
(`StateCache.last_tokens`). On the GPU one kernel resolves the token and copies its row, so a
decode graph spends one launch where torch spent four (compare, gather, where, index_select);
at TP > 1 it also zeroes the rows of tokens outside this rank's shard of the vocabulary,
which the all-reduce after it fills in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.triton_compat import (
    HAS_TRITON,
    check_index,
    check_launchable,
    check_vector,
    gpu_path,
    pdl_options,
    tl,
    triton,
    wait_for_previous_grid,
)


def embedding_reference(
    ids: torch.Tensor,
    weight: torch.Tensor,
    first: int,
    token_slots: torch.Tensor | None = None,
    last_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of `weight` (vocabulary rows first .. first + len - 1) for the resolved ids; a
    token outside them gets zeros."""
    if token_slots is not None:
        ids = torch.where(ids >= 0, ids, last_tokens[token_slots.clamp(min=0).long()])
    local = ids - first
    outside = (local < 0) | (local >= weight.shape[0])
    return F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[:, None], 0.0)


@triton.jit
def _embedding_kernel(
    ids_ptr,
    slots_ptr,
    last_ptr,
    w_ptr,
    out_ptr,
    first,
    rows_held,
    hidden,
    BLOCK: tl.constexpr,
    FROM_LAST: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # program: one token's row
    wait_for_previous_grid(GDC)
    r = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + r).to(tl.int64)
    if FROM_LAST:
        slot = tl.maximum(tl.load(slots_ptr + r).to(tl.int64), 0)
        token = tl.where(token < 0, tl.load(last_ptr + slot).to(tl.int64), token)
    local = token - first
    # features to read: none outside the shard
    held = tl.where((local >= 0) & (local < rows_held), hidden, 0)
    offs = tl.arange(0, BLOCK)
    row = tl.load(w_ptr + local * hidden + offs, mask=offs < held, other=0.0)
    tl.store(out_ptr + r * hidden + offs, row, mask=offs < hidden)


def embedding_triton(
    ids: torch.Tensor,
    weight: torch.Tensor,
    first: int,
    token_slots: torch.Tensor | None = None,
    last_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """`embedding_reference` in one kernel."""
    check_launchable(ids, weight)
    tokens = ids.shape[0]
    check_index("ids", ids, tokens)
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"embedding: weight must be contiguous [rows, hidden], got {tuple(weight.shape)}"
        )
    if token_slots is not None:
        check_index("token_slots", token_slots, tokens)
        if last_tokens is None:
            raise ValueError("embedding: token_slots need the slots' last_tokens [slots]")
        check_vector("last_tokens", last_tokens, None)
    out = torch.empty((tokens, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    if tokens:
        from_last = token_slots is not None
        _embedding_kernel[(tokens,)](
            ids,
            token_slots if from_last else ids,
            last_tokens if from_last else ids,
            weight,
            out,
            first,
            weight.shape[0],
            weight.shape[1],
            BLOCK=triton.next_power_of_2(weight.shape[1]),
            FROM_LAST=from_last,
            **pdl_options(ids),
        )
    return out


def embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    first: int = 0,
    token_slots: torch.Tensor | None = None,
    last_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T] ids -> [T, hidden] rows of weight; with `token_slots`, an id of -1 is its slot's
    last sample (`last_tokens[slot]`)."""
    if gpu_path(ids) and HAS_TRITON:
        return embedding_triton(ids, weight, first, token_slots, last_tokens)
    return embedding_reference(ids, weight, first, token_slots, last_tokens)
