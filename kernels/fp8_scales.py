"""FP8 weights with block scales in the skinny kernels (kernels/skinny_linear.py): how a GEMV
tile applies the scales, and the arguments every launch passes for them; `dequantize`, the
widened weight, is their reference (and what the loader widens a weight to).

The weight W = values x scales, one scale per [BM, BN] block (engine/rank/fp8.py). A GEMV tile's
rows lie in one row block (two for the MLP's [gate | up] tile), so scaling x once per row block
and column block costs one load per 128 columns, not one per weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltaserve.kernels.triton_compat import tl, triton

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 weight: block (i, j) (rows i*bm.., columns j*bn..; the last ones may be
    partial) times `scales[i, j]`. ValueError when the scales do not tile the weight."""
    if weight.dim() != 2:
        raise ValueError(
            f"an FP8 weight of shape {list(weight.shape)}: only matrices are quantized in blocks"
        )
    rows, cols = weight.shape
    bm, bn = block[0] or rows, block[1] or cols
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    if scales.numel() == 1 == math.prod(grid):  # one scale per tensor: [1] or []
        scales = scales.reshape(grid)
    if tuple(scales.shape) != grid:
        raise ValueError(
            f"its scales have shape {list(scales.shape)}, not {list(grid)} "
            f"(weight {[rows, cols]} in blocks of {[bm, bn]})"
        )
    return (
        weight.float()
        * scales.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    )


@triton.jit
def _x_tile(
    x, k_offs, hi, s_ptr, s_lo, s_hi, FP8: tl.constexpr, BN: tl.constexpr, TWO: tl.constexpr
):
    """x [BLOCK_K] in fp32 as the weight tile's rows multiply it: for FP8 weights, times each
    row's block scales (engine/rank/fp8.py) over these columns. `s_lo` / `s_hi`: offsets of the
    scale rows of the tile's (at most) two row blocks, `hi` the rows in the second (TWO: the
    SILU_MUL tile's up half)."""
    x = x.to(tl.float32)
    if FP8:
        lo = _scaled(x, s_ptr + s_lo, k_offs, BN)
        if TWO:
            tile = tl.where(hi[:, None], _scaled(x, s_ptr + s_hi, k_offs, BN)[None, :], lo[None, :])
        else:
            tile = lo[None, :]
    else:
        tile = x[None, :]
    return tile


@triton.jit
def _scaled(x, s_row, k_offs, BN: tl.constexpr):
    """x [BLOCK_K] (its columns k_offs, from a multiple of BN on) times the scale of each
    column's block in this scale row: one load per block, not per column."""
    blocks: tl.constexpr = x.shape[0] // BN
    scale = tl.load(s_row + tl.min(k_offs, axis=0) // BN + tl.arange(0, blocks))
    return tl.reshape(tl.reshape(x, (blocks, BN)) * scale[:, None], (x.shape[0],))


@dataclass(frozen=True, slots=True)
class Fp8Args:
    pointers: tuple  # the scales, their row stride, the weight's rows
    flags: dict  # FP8, BM, BN


def fp8_args(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int],
    fits: bool,
    tiles: object,
) -> Fp8Args:
    """The kernels' FP8 arguments (the weight itself when it is not FP8: never read). `fits`:
    whether the launch's `tiles` fit the blocks (skinny_linear.fp8_fits)."""
    if scale is None:
        if weight.dtype in FP8_DTYPES:
            raise ValueError("skinny_linear: an FP8 weight needs its block scales")
        return Fp8Args((weight, 0, weight.shape[0]), {})
    rows, k = weight.shape
    bm, bn = block
    if (
        weight.dtype not in FP8_DTYPES
        or scale.dtype != torch.float32
        or scale.stride(1) != 1
        or tuple(scale.shape) != (triton.cdiv(rows, bm), triton.cdiv(k, bn))
    ):
        raise ValueError(
            f"skinny_linear: scales {tuple(scale.shape)} {scale.dtype} do not fit the weight "
            f"{tuple(weight.shape)} {weight.dtype} in blocks of {block}"
        )
    if not fits:
        raise ValueError(f"skinny_linear: tiles of {tiles} do not fit FP8 blocks of {block}")
    return Fp8Args((scale, scale.stride(0), rows), {"FP8": True, "BM": bm, "BN": bn})
