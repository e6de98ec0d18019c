"""SwiGLU MLP: gate and up in one column-parallel GEMM, down row-parallel. On the GPU's decode
steps the block's norm runs inside gate_up's kernel and silu(gate) * up inside down's, as
each reads its input (kernels/skinny_linear.py); `silu_and_mul` and the norm's own kernel
otherwise."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.engine.rank.norm import RMSNorm
from deltaserve.kernels.skinny_linear import SILU_MUL, InputOp


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, ((intermediate,), (intermediate,)), dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), x + residual)."""
        gate_up, residual = norm.project(x, residual, self.gate_up_proj)
        return self.down_proj(gate_up, InputOp(SILU_MUL)), residual
