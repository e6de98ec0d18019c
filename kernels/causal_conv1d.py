"""Depthwise causal conv1d with carried state (the DeltaNet's short convolution), plain torch.

The state of a sequence is its last `width - 1` input columns, so that a prompt prefilled in
chunks sees exactly what one whole prefill would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,  # [L, C] pre-conv inputs of one sequence
    weight: torch.Tensor,  # [C, width]
    state: torch.Tensor,  # [C, width - 1] inputs before x (zeros at a request's start); updated in place
) -> torch.Tensor:  # [L, C], SiLU applied
    length = x.shape[0]
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, width - 1 + L]
    state.copy_(window[:, -state.shape[1] :])
    y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=x.shape[1])
    return F.silu(y[0, :, -length:].t())
