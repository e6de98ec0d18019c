"""Linear layers split across tensor-parallel ranks, and the loading rule of each parameter.

Every parameter carries a `weight_loader(param, checkpoint_tensor)` that copies this rank's
shard of the full checkpoint tensor and names the parameter if the shape is wrong (the idea
of nano-vllm's `layers/linear.py`). Column-parallel layers split output rows; row-parallel
layers split input columns and all-reduce their output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deltaserve.engine.rank.parallel import all_reduce, shard, tp_size
from deltaserve.kernels.skinny_linear import ConvEpilogue, SplitSum, linear

WeightLoader = Callable[[nn.Parameter, torch.Tensor], None]


def check_and_copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def sharded_loader(sections: tuple[int, ...] | None, dim: int, full_shape: tuple[int, ...]) -> WeightLoader:
    """A loader that checks the full checkpoint shape, then copies this rank's shard."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != full_shape:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, expected {full_shape}")
        check_and_copy(param, shard(loaded, sections or (full_shape[dim],), dim))

    return load


def new_param(shape: tuple[int, ...], loader: WeightLoader, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


def replicated_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A parameter every rank holds whole."""
    return new_param(shape, check_and_copy, dtype, device)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows split across ranks; `parts` are projections of the same input
    stacked into one GEMM (one weight read per step, one kernel instead of several).

    Each part is a tuple of sections split across ranks one by one (the DeltaNet's [Q | K | V]
    rows), so a rank holds matching heads of every section. The checkpoint keeps one tensor
    per part: `weight.weight_loader(param, tensor, part)` copies this rank's shard of it into
    the part's rows (nano-vllm's packed modules). Split the output with `local_sizes`.
    """

    def __init__(
        self,
        in_features: int,
        parts: tuple[tuple[int, ...], ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        tp = tp_size()
        self.local_sizes = tuple(sum(sections) // tp for sections in parts)
        offsets = [sum(self.local_sizes[:i]) for i in range(len(parts))]
        part_loaders = [sharded_loader(sections, 0, (sum(sections), in_features)) for sections in parts]

        def load(param: nn.Parameter, loaded: torch.Tensor, part: int = 0) -> None:
            part_loaders[part](param.data.narrow(0, offsets[part], self.local_sizes[part]), loaded)

        self.weight = new_param((sum(self.local_sizes), in_features), load, dtype, device)
        self.weight.num_parts = len(parts)

    def forward(self, x: torch.Tensor, silu_mul: bool = False, conv: ConvEpilogue | None = None) -> torch.Tensor:
        """silu_mul: the parts are the MLP's (gate, up); returns silu(gate) * up. conv: the
        DeltaNet's conv over the first columns (skinny_linear.linear)."""
        return linear(x, self.weight, silu_mul, conv=conv)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T: W's columns split, output all-reduced."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        local = in_features // tp_size()
        loader = sharded_loader(None, 1, (out_features, in_features))
        self.weight = new_param((out_features, local), loader, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSum:
        """At TP=1 a K-split product may come back unsummed: every caller hands the output
        to the next norm (`RMSNorm.add`), which adds the parts itself."""
        if tp_size() == 1:
            return linear(x, self.weight, unsummed=True)
        return all_reduce(linear(x, self.weight))
