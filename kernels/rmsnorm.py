"""The two RMSNorms of Qwen3.5, plain torch, computed in fp32.

Every norm of the model is zero-centred, x * rsqrt(mean(x^2) + eps) * (1 + w), except the
gated norm inside the DeltaNet layer, which scales by plain w and multiplies by silu(z).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF does it: normalise in fp32, cast back, scale by w, then gate by silu(z) in fp32."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y.float() * F.silu(z.float())).to(x.dtype)
