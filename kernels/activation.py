"""The gated products: SiLU-and-mul of the SwiGLU MLP over the merged [gate | up] projection
output, and the sigmoid output gate of full attention.

HF computes act_fn(gate) * up (and attn * sigmoid(gate)) in the model dtype: the activation
rounded to the dtype, then the product rounded again. The references keep those roundings;
each Triton kernel does the same in one pass (one kernel instead of activation, mul, slices).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.triton_compat import (
    HAS_TRITON,
    check_launchable,
    gpu_path,
    pdl_options,
    tl,
    triton,
    wait_for_previous_grid,
)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] -> [T, I]: silu(gate) * up."""
    if gpu_path(gate_up) and HAS_TRITON:
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_reference(gate_up)


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in fp32 from fp32 products, rounded as `silu_and_mul_reference` rounds
    in `dtype`: each product, then silu(gate) (the caller rounds the result)."""
    g = gate.to(dtype).to(tl.float32)
    return (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, width, BLOCK: tl.constexpr, GDC: tl.constexpr = False
):
    # program: BLOCK features of one row
    wait_for_previous_grid(GDC)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < width
    gate = tl.load(x_ptr + r * stride_x + offs, mask=m, other=0.0)
    up = tl.load(x_ptr + r * stride_x + width + offs, mask=m, other=0.0)
    tl.store(
        out_ptr + r * width + offs,
        silu_times(gate, up, gate.dtype).to(out_ptr.dtype.element_ty),
        mask=m,
    )


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    check_launchable(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up: expected [T, 2 I] with unit last stride, got {tuple(gate_up.shape)}"
        )
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), width, BLOCK=block, **pdl_options(gate_up)
        )
    return out


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


@triton.jit
def times_sigmoid(x, g):
    """x * sigmoid(g) in fp32, rounded as `sigmoid_gate_reference` in x's dtype rounds:
    sigmoid(g) to g's dtype first (the caller rounds the product)."""
    return x.to(tl.float32) * tl.sigmoid(g.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr,
    gate_ptr,
    out_ptr,
    stride_gate_row,
    stride_gate_head,
    heads,
    dim,
    BLOCK: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # program: one (token, head) row of `dim` features; x and out contiguous, gate strided
    wait_for_previous_grid(GDC)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < dim
    x = tl.load(x_ptr + r * dim + offs, mask=m, other=0.0)
    g = tl.load(
        gate_ptr + (r // heads) * stride_gate_row + (r % heads) * stride_gate_head + offs,
        mask=m,
        other=0.0,
    )
    tl.store(out_ptr + r * dim + offs, times_sigmoid(x, g).to(out_ptr.dtype.element_ty), mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] * sigmoid(gate) (gate: the same shape, rows may be strided, as the
    gate half of q_proj's [query | gate] output)."""
    if gpu_path(x) and HAS_TRITON:
        return sigmoid_gate_triton(x, gate)
    return sigmoid_gate_reference(x, gate)


def sigmoid_gate_triton(
    x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`sigmoid_gate_reference` in one kernel, into `out` (contiguous like x) or a new tensor."""
    check_launchable(x, gate)
    if x.dim() != 3 or gate.shape != x.shape or not x.is_contiguous() or gate.stride(2) != 1:
        raise ValueError(
            f"sigmoid_gate: x {tuple(x.shape)} (contiguous) and gate {tuple(gate.shape)} "
            f"(unit last stride) must be [T, heads, dim], got strides {gate.stride()}"
        )
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"sigmoid_gate: out must be contiguous {tuple(x.shape)}")
    tokens, heads, dim = x.shape
    if tokens:
        _sigmoid_gate_kernel[(tokens * heads,)](
            x,
            gate,
            out,
            gate.stride(0),
            gate.stride(1),
            heads,
            dim,
            BLOCK=triton.next_power_of_2(dim),
            num_warps=1,
            **pdl_options(x),
        )
    return out
