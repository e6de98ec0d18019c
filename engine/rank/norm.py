"""RMSNorm modules holding their (replicated) weight; the math is in kernels/rmsnorm.py."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.linear import ColumnParallelLinear, replicated_param
from deltaserve.kernels.rmsnorm import add_rms_norm, rms_norm
from deltaserve.kernels.skinny_linear import GATED_NORM, InputOp, add_norm_linear


class RMSNorm(nn.Module):
    """Zero-centred: scales by (1 + w)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)

    def project(
        self, x: torch.Tensor, residual: torch.Tensor | None, proj: ColumnParallelLinear
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(norm(x + residual)), x + residual): a block's pre-norm and the projection
        after it, one kernel on a decode step (skinny_linear.add_norm_linear). No residual
        (the first block): (proj(norm(x)), x)."""
        if residual is None:
            return proj(self(x)), x
        return add_norm_linear(x, residual, self.weight, self.eps, proj.weight)


class GatedRMSNorm(nn.Module):
    """Plain w, times silu(z): only inside the DeltaNet layer."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param((dim,), dtype, device)

    def op(self, z: torch.Tensor) -> InputOp:
        """The norm of out_proj's input [T, heads * dim], gated by z [T, heads, dim]: made by
        out_proj's kernel as it reads it, or by `gated_rms_norm` first."""
        return InputOp(GATED_NORM, z, self.weight, self.eps, z.shape[-1])
