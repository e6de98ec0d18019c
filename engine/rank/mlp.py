"""SwiGLU MLP: gate and up in one column-parallel GEMM, down row-parallel."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.kernels.activation import silu_and_mul


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, ((intermediate,), (intermediate,)), dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
