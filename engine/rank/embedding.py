"""Vocabulary-parallel embedding and lm_head: each rank holds vocab_size / tp rows."""

from __future__ import annotations

import math

import torch
from torch import nn

from deltaserve.engine.rank.linear import new_param, sharded_loader
from deltaserve.engine.rank.parallel import (
    all_gather,
    all_reduce,
    gather_last_dim,
    tp_rank,
    tp_size,
)
from deltaserve.kernels.embedding import embedding
from deltaserve.kernels.skinny_linear import logits


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        if vocab_size % tp_size():
            raise ValueError(f"vocab_size {vocab_size} does not split over {tp_size()} ranks")
        self.rows = vocab_size // tp_size()
        self.first = tp_rank() * self.rows
        loader = sharded_loader(None, 0, (vocab_size, hidden))
        self.weight = new_param((self.rows, hidden), loader, dtype, device)

    def forward(
        self,
        ids: torch.Tensor,
        token_slots: torch.Tensor | None = None,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows of the ids; with `token_slots`, an id of -1 is its slot's `last_tokens` entry.
        A rank's rows of ids outside its shard are zeros, filled in by the all-reduce."""
        out = embedding(ids, self.weight, self.first, token_slots, last_tokens)
        return out if tp_size() == 1 else all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary fp32 logits on rank 0 (None elsewhere; skinny_linear.logits)."""
        return gather_last_dim(logits(hidden, self.weight))

    def argmax(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """Each row's argmax token among the vocabulary's first `rows` ids, on every rank: each
        rank reads only its shard's rows of those ids (a view, no copy), and the ranks swap a
        (best logit, id) pair per row instead of gathering the logits."""
        return best_of(all_gather(shard_best(hidden, self.weight, self.first, rows)))


def shard_best(hidden: torch.Tensor, weight: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """A shard's (ids first .. first + len(weight)) best logit among the vocabulary's first
    `rows` ids for each row of `hidden`, and its id: [T, 2] float64, which holds an fp32 logit
    and an id exactly; (-inf, 0) where the shard holds none of those ids."""
    local = min(weight.shape[0], max(0, rows - first))
    out = torch.zeros((hidden.shape[0], 2), dtype=torch.float64, device=hidden.device)
    if local == 0:
        out[:, 0] = -math.inf
        return out
    best, at = logits(hidden, weight[:local]).max(dim=-1)
    out[:, 0] = best
    out[:, 1] = at + first
    return out


def best_of(parts: torch.Tensor) -> torch.Tensor:
    """The id [T] of each row's best logit over the shards' `shard_best` [ranks, T, 2]; on a
    tie the lowest rank's, so the lowest id, as an argmax over the whole row picks."""
    rank = parts[..., 0].argmax(dim=0)
    return parts[..., 1].gather(0, rank[None]).squeeze(0).long()
