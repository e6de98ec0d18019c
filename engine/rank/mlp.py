"""SwiGLU MLP: gate/up column-parallel, down row-parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.engine.rank.linear import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, (intermediate,), dtype, device)
        self.up_proj = ColumnParallelLinear(hidden, (intermediate,), dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
