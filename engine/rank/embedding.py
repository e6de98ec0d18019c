"""Vocabulary-parallel embedding and lm_head: each rank holds vocab_size / tp rows."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.linear import new_param, sharded_loader
from deltaserve.engine.rank.parallel import all_reduce, gather_last_dim, tp_rank, tp_size
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
