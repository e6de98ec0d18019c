"""SiLU-and-mul of the SwiGLU MLP over the merged [gate | up] projection output.

HF computes act_fn(gate) * up in the model dtype: silu rounded to the dtype, then the product
rounded again. The reference keeps those roundings; the Triton kernel does the same in one
pass over the merged tensor (one kernel instead of silu, mul and two slices).
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
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, width, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
    # program: BLOCK features of one row
    wait_for_previous_grid(GDC)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < width
    gate = tl.load(x_ptr + r * stride_x + offs, mask=m, other=0.0)
    up = tl.load(x_ptr + r * stride_x + width + offs, mask=m, other=0.0)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + r * width + offs, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    check_launchable(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up: expected [T, 2 I] with unit last stride, got {tuple(gate_up.shape)}")
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), width, BLOCK=block, **pdl_options(gate_up)
        )
    return out
