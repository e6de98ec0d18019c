"""Tensor-parallel plumbing: this rank's place in the group, shard selection, all-reduce.

The rank process initialises torch.distributed (WORLD) before building the model; with one
rank, or none initialised, every collective here is a no-op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x`, in place (on CUDA queued on the stream)."""
    if tp_size() > 1:
        dist.broadcast(x, src=0)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `x` along the last dim on rank 0; other ranks get None.

    On CUDA an all-gather (a collective NCCL can capture in a CUDA graph, where a gather is
    point-to-point work); on the CPU (gloo) a gather to rank 0."""
    size = tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:
        parts = all_gather(x)
        return torch.cat(parts.unbind(0), dim=-1) if tp_rank() == 0 else None
    parts = [torch.empty_like(x) for _ in range(size)] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` on every rank, stacked: [ranks, *x.shape] (gloo's list form on the
    CPU, which has no all_gather_into_tensor)."""
    size = tp_size()
    if size == 1:
        return x[None]
    x = x.contiguous()
    if x.is_cuda:
        parts = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(parts, x)
        return parts
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x)
    return torch.stack(parts)


def shard(full: torch.Tensor, sections: tuple[int, ...], dim: int = 0) -> torch.Tensor:
    """This rank's part of `full` along `dim`: each of the consecutive `sections` (sizes
    summing to full.shape[dim]) is split evenly and this rank's slices are concatenated.

    A fused projection such as the DeltaNet's [Q | K | V] rows is sharded section by section,
    so that each rank holds matching heads of all three.
    """
    if sum(sections) != full.shape[dim]:
        raise ValueError(f"sections {sections} do not cover dim {dim} of shape {tuple(full.shape)}")
    rank, size = tp_rank(), tp_size()
    parts, offset = [], 0
    for length in sections:
        if length % size:
            raise ValueError(f"section of {length} rows does not split over {size} ranks")
        step = length // size
        parts.append(full.narrow(dim, offset + rank * step, step))
        offset += length
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
