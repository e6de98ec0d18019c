"""RMSNorm modules holding their (replicated) weight; the math is in kernels/rmsnorm.py."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.linear import replicated_param
from deltaserve.kernels.rmsnorm import add_rms_norm, gated_rms_norm, rms_norm
from deltaserve.kernels.skinny_linear import SplitSum


class RMSNorm(nn.Module):
    """Zero-centred: scales by (1 + w)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor | SplitSum, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm; x may be a
        row-parallel projection's partial sums (kernels/skinny_linear.py), added first."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Plain w, times silu(z): only inside the DeltaNet layer."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)
