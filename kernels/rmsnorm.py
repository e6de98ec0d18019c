"""The two RMSNorms of Qwen3.5, computed in fp32: plain torch references and Triton kernels.

Every norm of the model is zero-centred, x * rsqrt(mean(x^2) + eps) * (1 + w), except the
gated norm inside the DeltaNet layer, which scales by plain w and multiplies by silu(z).
`rms_norm` and `gated_rms_norm` run the reference on the CPU and one Triton kernel on CUDA
(the reference's roundings kept); `*_reference` are the plain torch versions.

`add_rms_norm` is the pre-norm of every block after the first: the residual add (in the
model dtype, as HF adds) and the norm of the sum in one pass, returning both (vLLM's
fused_add_rms_norm idea): one kernel and one read of the stream instead of two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.skinny_linear import SplitSum
from deltaserve.kernels.triton_compat import (
    HAS_TRITON,
    check_launchable,
    gpu_path,
    pdl_options,
    rows_per_program,
    tl,
    triton,
    wait_for_previous_grid,
)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def gated_rms_norm_reference(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """As HF does it: normalise in fp32, cast back, scale by w, then gate by silu(z) in fp32."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y.float() * F.silu(z.float())).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if gpu_path(x) and HAS_TRITON:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor | SplitSum, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x may be a projection's partial sums (`SplitSum`, GPU path only): added in order first."""
    if isinstance(x, SplitSum) or (gpu_path(x) and HAS_TRITON):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if gpu_path(x) and HAS_TRITON:
        return gated_rms_norm_triton(x, z, weight, eps)
    return gated_rms_norm_reference(x, z, weight, eps)


@triton.jit(do_not_specialize=["num_rows"])  # one kernel for every row count (a prompt's are any)
def _rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_z,
    stride_z_head,
    z_heads,
    dim,
    eps,
    stride_split,
    num_rows,
    GATED: tl.constexpr,
    ADD: tl.constexpr,
    BD: tl.constexpr,
    SPLITS: tl.constexpr = 1,
    ROWS: tl.constexpr = 1,
    GDC: tl.constexpr = False,
):
    # program: ROWS rows of `dim` features; ADD: z is the residual, the sum goes to sum_ptr.
    # z's row r is head r % z_heads of token r // z_heads: read in place from a strided view.
    # SPLITS > 1: x is a projection's fp32 partial sums (SplitSum), `stride_split` apart,
    # added in order and rounded to out's dtype as skinny_linear's `_sum_splits_kernel` does
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    z_row = z_ptr + (r // z_heads) * stride_z + (r % z_heads) * stride_z_head
    offs = tl.arange(0, BD)[None, :]
    m = (offs < dim) & (r < num_rows)
    wait_for_previous_grid(GDC)
    x = tl.load(x_ptr + r * stride_x + offs, mask=m, other=0.0)
    if SPLITS > 1:
        for s in tl.static_range(1, SPLITS):
            x += tl.load(x_ptr + s * stride_split + r * stride_x + offs, mask=m, other=0.0)
        x = x.to(out_ptr.dtype.element_ty)
    if ADD:
        res = tl.load(z_row + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + r * dim + offs, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 1) / dim + eps)[:, None]
    w = tl.load(w_ptr + offs, mask=offs < dim, other=0.0)
    if GATED:
        y = (xf * inv).to(x.dtype).to(tl.float32)  # cast back, then w * y in the model dtype
        y = (w.to(tl.float32) * y).to(x.dtype).to(tl.float32)
        z = tl.load(z_row + offs, mask=m, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    else:
        y = xf * inv * (1.0 + w.to(tl.float32))
    tl.store(out_ptr + r * dim + offs, y.to(out_ptr.dtype.element_ty), mask=m)


# Warps of a program on a row of 2048 features or more (tools/bench_step_ab.py's norm modes).
WIDE_ROW_WARPS = 8


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[..., dim] as [rows, dim] without a copy where the strides allow (q[..., :hd] of a
    [T, heads, 2 hd] tensor does), else a contiguous copy."""
    if t.dim() < 1 or t.shape[-1] < 1:
        raise ValueError(f"{name}: expected [..., dim] with dim >= 1, got {tuple(t.shape)}")
    if t.stride(-1) == 1:
        try:
            return t.view(-1, t.shape[-1])
        except RuntimeError:
            pass
    return t.reshape(-1, t.shape[-1]).contiguous()


def _launch(
    x: torch.Tensor | SplitSum,
    z: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    add: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm, sum): z is the gate, or with `add` the residual; sum is x + z (else x)."""
    splits, stride_split, dtype = 1, 0, None
    if isinstance(x, SplitSum):  # [splits, rows, dim] fp32, contiguous (skinny_linear)
        if not add or x.parts.dim() != 3 or not x.parts.is_contiguous():
            raise ValueError(
                "partial sums are taken by the residual add only, as [splits, rows, dim] contiguous"
            )
        splits, stride_split, dtype = x.parts.shape[0], x.parts.stride(0), x.dtype
        x = x.parts[0]
    check_launchable(x, weight)
    dim = x.shape[-1]
    if weight.shape != (dim,) or weight.stride(0) != 1:
        raise ValueError(f"weight: expected contiguous ({dim},), got {tuple(weight.shape)}")
    rows = _rows("x", x)
    gate, z_heads, stride_z_head = rows, 1, 0
    if z is not None:
        if z.shape != x.shape:
            raise ValueError(f"z {tuple(z.shape)} must match x {tuple(x.shape)}")
        if z.dim() == 3 and z.stride(2) == 1:  # [T, heads, dim] rows of a wider tensor: no copy
            gate, z_heads, stride_z_head = z, z.shape[1], z.stride(1)
        else:
            gate = _rows("z", z)
    out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    total = torch.empty_like(out) if add else x
    if rows.shape[0] == 0:
        return out, total
    block = triton.next_power_of_2(dim)
    per_program = rows_per_program()
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], per_program),)](
        rows,
        gate,
        weight,
        out,
        total,
        rows.stride(0),
        gate.stride(0),
        stride_z_head,
        z_heads,
        dim,
        eps,
        stride_split,
        rows.shape[0],
        GATED=z is not None and not add,
        ADD=add,
        BD=block,
        SPLITS=splits,
        ROWS=per_program,
        num_warps=WIDE_ROW_WARPS if block >= 2048 else 4 if block >= 512 else 1,
        **pdl_options(x),
    )
    return out, total


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` in one kernel; out is a new contiguous tensor of x's shape."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor | SplitSum, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` in one kernel; x may be partial sums (`SplitSum`)."""
    return _launch(x, residual, weight, eps, add=True)


def gated_rms_norm_triton(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`gated_rms_norm_reference` in one kernel."""
    return _launch(x, z, weight, eps)[0]
