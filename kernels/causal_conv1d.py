"""Depthwise causal conv1d with carried state (the DeltaNet's short convolution), plain torch.

The state of a sequence is its last `width - 1` input columns, so that a prompt prefilled in
chunks sees exactly what one whole prefill would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.triton_compat import check_index, check_launchable, check_rows, tl, triton


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


# ---- decode step on the GPU: one token of every decode request, state updated in place ----


def causal_conv1d_update_reference(
    x: torch.Tensor,  # [T, C] pre-conv inputs of the step
    weight: torch.Tensor,  # [C, width]
    state: torch.Tensor,  # [slots, C, width - 1], updated in place at `slots`
    rows: torch.Tensor,  # [D] token of each decode request
    slots: torch.Tensor,  # [D] its state slot
    out: torch.Tensor,  # [T, C]; rows `rows` are written (SiLU applied)
) -> None:
    """`causal_conv1d` on one token per request, request by request."""
    for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
        out[row : row + 1] = causal_conv1d(x[row : row + 1], weight, state[slot])


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, state_ptr, rows_ptr, slots_ptr, out_ptr,
    stride_x, stride_w, stride_slot, stride_channel, stride_out,
    channels,
    WIDTH: tl.constexpr, BC: tl.constexpr,
):
    # program: (decode request i, block of BC channels); the state window shifts left by one
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    limit = tl.where(slot >= 0, channels, 0)  # slot < 0: a CUDA-graph padding row, untouched
    slot = tl.maximum(slot, 0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    m = offs < limit
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    acc = tl.load(w_ptr + offs * stride_w + (WIDTH - 1), mask=m, other=0.0).to(tl.float32) * x.to(tl.float32)
    window = state_ptr + slot * stride_slot + offs * stride_channel
    for j in tl.static_range(WIDTH - 1):
        prev = tl.load(window + j, mask=m, other=0.0)
        acc += tl.load(w_ptr + offs * stride_w + j, mask=m, other=0.0).to(tl.float32) * prev.to(tl.float32)
        if j > 0:
            tl.store(window + (j - 1), prev, mask=m)
    tl.store(window + (WIDTH - 2), x.to(state_ptr.dtype.element_ty), mask=m)
    y = acc.to(x.dtype).to(tl.float32)  # the conv output is rounded to the model dtype first
    tl.store(out_ptr + row * stride_out + offs, (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty), mask=m)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Triton launch of `causal_conv1d_update_reference` (same arguments), all requests in
    one kernel. Rows with slot < 0 are skipped."""
    check_launchable(x, state)
    channels, width = weight.shape
    if width < 2:
        raise ValueError(f"conv width must be >= 2, got {width}")
    check_rows("x", x, channels)
    check_rows("out", out, channels)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out needs {x.shape[0]} rows, got {out.shape[0]}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight: expected a contiguous last dim, got strides {weight.stride()}")
    if state.dim() != 3 or state.shape[1:] != (channels, width - 1) or state.stride(2) != 1:
        raise ValueError(f"state: expected [slots, {channels}, {width - 1}] with a contiguous last "
                         f"dim, got {tuple(state.shape)} strides {state.stride()}")
    num = rows.shape[0]
    check_index("rows", rows, num)
    check_index("slots", slots, num)
    if num == 0:
        return
    block = min(1024, triton.next_power_of_2(channels))
    grid = (num, triton.cdiv(channels, block))
    _conv_update_kernel[grid](
        x, weight, state, rows, slots, out,
        x.stride(0), weight.stride(0), state.stride(0), state.stride(1), out.stride(0),
        channels, WIDTH=width, BC=block, num_warps=4,
    )
