"""Linear layers split across tensor-parallel ranks, and the loading rule of each parameter.

Every parameter carries a `weight_loader(param, checkpoint_tensor)` that copies this rank's
shard of the full checkpoint tensor and names the parameter if the shape is wrong (the idea
of nano-vllm's `layers/linear.py`). Column-parallel layers split output rows; row-parallel
layers split input columns and all-reduce their output.

An FP8 release's projections may stay FP8 (`keep_fp8`, decided by the loader before any tensor
loads): the weight in float8_e4m3fn and beside it `weight_scale_inv`, its block scales, sharded
with it, which is possible where every rank's shard is whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from deltaserve.engine.rank.parallel import all_reduce, shard, tp_size
from deltaserve.kernels.skinny_linear import ConvEpilogue, SplitSum, linear

WeightLoader = Callable[[nn.Parameter, torch.Tensor], None]


def check_and_copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(
            f"shape {tuple(loaded.shape)} does not fit parameter of shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def sharded_loader(
    sections: tuple[int, ...] | None, dim: int, full_shape: tuple[int, ...]
) -> WeightLoader:
    """A loader that checks the full checkpoint shape, then copies this rank's shard."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != full_shape:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, expected {full_shape}")
        check_and_copy(param, shard(loaded, sections or (full_shape[dim],), dim))

    return load


def new_param(
    shape: tuple[int, ...], loader: WeightLoader, dtype: torch.dtype, device: torch.device
) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


def replicated_param(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> nn.Parameter:
    """A parameter every rank holds whole."""
    return new_param(shape, check_and_copy, dtype, device)


class Fp8Weight(nn.Module):
    """What the two parallel layers share: the FP8 weight and its scales, once kept."""

    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight_scale_inv", None)  # until kept
        self.fp8_block = (1, 1)

    def hold_fp8(self, block: tuple[int, int], scale_shape: tuple[int, int], scale_loader) -> None:
        """The weight becomes FP8 (same shape and loader), with fp32 scales of `scale_shape`."""
        old = self.weight
        self.weight = new_param(
            tuple(old.shape), old.weight_loader, torch.float8_e4m3fn, old.device
        )
        self.weight_scale_inv = new_param(scale_shape, scale_loader, torch.float32, old.device)
        if hasattr(old, "num_parts"):
            self.weight.num_parts = self.weight_scale_inv.num_parts = old.num_parts
        self.fp8_block = block

    def product(self, x: torch.Tensor, **kwargs) -> torch.Tensor | SplitSum:
        return linear(x, self.weight, scale=self.weight_scale_inv, block=self.fp8_block, **kwargs)


class ColumnParallelLinear(Fp8Weight):
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
        self.parts, self.in_features = parts, in_features
        self.local_sizes = tuple(sum(sections) // tp_size() for sections in parts)
        self.weight = new_param(
            (sum(self.local_sizes), in_features), self.parts_loader(1, 1), dtype, device
        )
        self.weight.num_parts = len(parts)

    def parts_loader(self, bm: int, bn: int) -> Callable[..., None]:
        """The loader of the weight (bm = bn = 1) or of its block scales: each part's rows of
        this rank, section by section, into the part's place."""
        local = [size // bm for size in self.local_sizes]
        offsets = [sum(local[:i]) for i in range(len(local))]
        columns = math.ceil(self.in_features / bn)
        part_loaders = [
            sharded_loader(tuple(s // bm for s in sections), 0, (sum(sections) // bm, columns))
            for sections in self.parts
        ]

        def load(param: nn.Parameter, loaded: torch.Tensor, part: int = 0) -> None:
            part_loaders[part](param.data.narrow(0, offsets[part], local[part]), loaded)

        return load

    def keep_fp8(self, block: tuple[int, int]) -> bool:
        """Hold the weight as FP8 (False: where a rank's
        shard of a section is not whole row blocks)."""
        bm, bn = block
        if any(section % (bm * tp_size()) for sections in self.parts for section in sections):
            return False
        shape = (sum(self.local_sizes) // bm, math.ceil(self.in_features / bn))
        self.hold_fp8(block, shape, self.parts_loader(bm, bn))
        return True

    def forward(
        self, x: torch.Tensor, silu_mul: bool = False, conv: ConvEpilogue | None = None
    ) -> torch.Tensor:
        """silu_mul: the parts are the MLP's (gate, up); returns silu(gate) * up. conv: the
        DeltaNet's conv over the first columns (skinny_linear.linear)."""
        return self.product(x, silu_mul=silu_mul, conv=conv)


class RowParallelLinear(Fp8Weight):
    """y = sum over ranks of x_r W_r^T: W's columns split, output all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        local = in_features // tp_size()
        loader = sharded_loader(None, 1, (out_features, in_features))
        self.weight = new_param((out_features, local), loader, dtype, device)

    def keep_fp8(self, block: tuple[int, int]) -> bool:
        """Hold the weight as FP8 (False: where a rank's columns are not whole column blocks)."""
        bm, bn = block
        if self.in_features % (bn * tp_size()):
            return False
        full = (math.ceil(self.out_features / bm), self.in_features // bn)
        self.hold_fp8(block, (full[0], full[1] // tp_size()), sharded_loader(None, 1, full))
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSum:
        """At TP=1 a K-split product may come back unsummed: every caller hands the output
        to the next norm (`RMSNorm.add`), which adds the parts itself."""
        if tp_size() == 1:
            return self.product(x, unsummed=True)
        return all_reduce(self.product(x))
