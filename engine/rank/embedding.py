"""Vocabulary-parallel embedding and lm_head: each rank holds vocab_size / tp rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.engine.rank.linear import new_param, sharded_loader
from deltaserve.engine.rank.parallel import all_reduce, gather_last_dim, tp_rank, tp_size
from deltaserve.kernels.skinny_linear import logits


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if vocab_size % tp_size():
            raise ValueError(f"vocab_size {vocab_size} does not split over {tp_size()} ranks")
        self.rows = vocab_size // tp_size()
        self.first = tp_rank() * self.rows
        loader = sharded_loader(None, 0, (vocab_size, hidden))
        self.weight = new_param((self.rows, hidden), loader, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[:, None], 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary fp32 logits on rank 0 (None elsewhere; skinny_linear.logits)."""
        return gather_last_dim(logits(hidden, self.weight))
