"""SwiGLU MLP: gate and up in one column-parallel GEMM, down row-parallel; the activation
silu(gate) * up is made by the gate_up kernel's epilogue (kernels/skinny_linear.py) on the
GPU's decode steps, by `silu_and_mul` after the GEMM otherwise."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.kernels.skinny_linear import SplitSum


class MLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden, ((intermediate,), (intermediate,)), dtype, device
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSum:
        return self.down_proj(self.gate_up_proj(x, silu_mul=True))
