"""Depthwise causal conv1d with carried state (the DeltaNet's short convolution), plain torch.

The state of a sequence is its last `width - 1` input columns, so that a prompt prefilled in
chunks sees exactly what one whole prefill would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.triton_compat import (
    check_index,
    check_launchable,
    check_rows,
    pdl_options,
    read_ahead,
    tl,
    triton,
    wait_for_previous_grid,
)


def causal_conv1d(
    x: torch.Tensor,  # [L, C] pre-conv inputs of one sequence
    weight: torch.Tensor,  # [C, width]
    # [C, width - 1] inputs before x (zeros at a request's start); updated in place
    state: torch.Tensor,
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


def _check_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, out: torch.Tensor
) -> tuple[int, int]:
    """The conv kernels' shared argument checks; returns (channels, width)."""
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
        raise ValueError(
            f"state: expected [slots, {channels}, {width - 1}] with a contiguous last "
            f"dim, got {tuple(state.shape)} strides {state.stride()}"
        )
    return channels, width


@triton.jit
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    rows_ptr,
    slots_ptr,
    out_ptr,
    stride_x,
    stride_w,
    stride_slot,
    stride_channel,
    stride_out,
    channels,
    WIDTH: tl.constexpr,
    WP: tl.constexpr,
    BC: tl.constexpr,
    GDC: tl.constexpr = False,
    GDC_LATE: tl.constexpr = False,
):
    # program: (decode request i, block of BC channels); the state window shifts left by one.
    # Every load comes before the first store: a store to the window could alias a later
    # load, and the compiler would then keep each load behind the store before it. All but
    # the new input x are read ahead of the wait (only this kernel writes the window).
    wait_for_previous_grid(GDC)
    i = tl.program_id(0)
    slot = read_ahead(slots_ptr + i).to(tl.int64)
    row = read_ahead(rows_ptr + i).to(tl.int64)
    limit = tl.where(slot >= 0, channels, 0)  # slot < 0: a CUDA-graph padding row, untouched
    slot = tl.maximum(slot, 0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    taps = tl.arange(0, WP)[None, :]  # [1, WP]: tap j of the window, WIDTH - 1 the new input
    m = offs < limit
    in_window = m[:, None] & (taps < WIDTH - 1)
    window = state_ptr + slot * stride_slot + offs[:, None] * stride_channel + taps
    prev = read_ahead(window, in_window, 0.0)  # [BC, WP]
    # the window shifted by one
    after = read_ahead(window + 1, m[:, None] & (taps < WIDTH - 2), 0.0)
    w = read_ahead(w_ptr + offs[:, None] * stride_w + taps, m[:, None] & (taps < WIDTH), 0.0)
    wait_for_previous_grid(GDC_LATE)
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    inputs = tl.where(taps == WIDTH - 1, x[:, None], prev)
    acc = tl.sum(w.to(tl.float32) * inputs.to(tl.float32), axis=1)
    tl.store(
        window,
        tl.where(taps == WIDTH - 2, x[:, None].to(state_ptr.dtype.element_ty), after),
        mask=in_window,
    )
    y = acc.to(x.dtype).to(tl.float32)  # the conv output is rounded to the model dtype first
    tl.store(
        out_ptr + row * stride_out + offs, (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty), mask=m
    )


# Channels and warps per program of the decode update: many small programs, each a short
# chain of loads. 128 x 1 warp took 0.02 ms off the H200's step at 1-32 rows and 0.065 at 64
# against 1024 x 4 (bench/results/step_ab_h200_conv_norm_tiles_at_60fede8.json); at 5757158,
# 256 x 2 took another 0.03 ms off at 32 rows and 0.03-0.045 at 64, for 3 us more at 8
# (tools/bench_step_ab.py's conv modes, bench/results/step_ab_h200_conv_tiles_at_5757158.json,
# step_ab_h200_conv256_adopted_at_04a644d.json). One row's conv is in_proj's.
UPDATE_TILE = (256, 2)


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
    channels, width = _check_conv(x, weight, state, out)
    num = rows.shape[0]
    check_index("rows", rows, num)
    check_index("slots", slots, num)
    if num == 0:
        return
    block, warps = UPDATE_TILE
    block = min(block, triton.next_power_of_2(channels))
    grid = (num, triton.cdiv(channels, block))
    _conv_update_kernel[grid](
        x,
        weight,
        state,
        rows,
        slots,
        out,
        x.stride(0),
        weight.stride(0),
        state.stride(0),
        state.stride(1),
        out.stride(0),
        channels,
        WIDTH=width,
        WP=triton.next_power_of_2(width),
        BC=block,
        num_warps=warps,
        **pdl_options(x, reads_ahead="conv"),
    )


# ---- prefill on the GPU: every prompt chunk of a step, packed in one token array ----


def causal_conv1d_prefill_reference(
    x: torch.Tensor,  # [T, C] pre-conv inputs of the step
    weight: torch.Tensor,  # [C, width]
    state: torch.Tensor,  # [slots, C, width - 1], updated in place at `slots`
    offsets: torch.Tensor,  # [n] first token row of each span
    lengths: torch.Tensor,  # [n] its tokens
    slots: torch.Tensor,  # [n] its state slot
    out: torch.Tensor,  # [T, C]; the spans' rows are written (SiLU applied)
) -> None:
    """`causal_conv1d` on each span, span by span."""
    spans = zip(offsets.tolist(), lengths.tolist(), slots.tolist(), strict=True)
    for offset, length, slot in spans:
        piece = slice(offset, offset + length)
        out[piece] = causal_conv1d(x[piece], weight, state[slot])


@triton.jit(
    do_not_specialize_on_alignment=["offsets_ptr", "lengths_ptr", "slots_ptr"]
)  # PackedSpans.index rows
def _conv_prefill_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    offsets_ptr,
    lengths_ptr,
    slots_ptr,
    blocks_ptr,
    out_ptr,
    stride_x,
    stride_w,
    stride_slot,
    stride_channel,
    stride_out,
    channels,
    WIDTH: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    # program: (entry e of the block table: span i, its block of BT tokens; block of BC
    # channels). Token p's tap j reads input p - (WIDTH-1) + j of the span, or state column
    # p + j when that input is negative: only token block 0 (BT >= WIDTH - 1) reads the state,
    # and only it writes the new one, after a barrier. An entry past the span's end (a padding
    # entry naming an empty span) does nothing. Offsets inside a span are int32 (the wrapper
    # checks), the rest int64.
    e = tl.program_id(0)
    i = tl.load(blocks_ptr + 2 * e)
    first = tl.load(blocks_ptr + 2 * e + 1) * BT
    length = tl.load(lengths_ptr + i)
    if first >= length:
        return
    offset = tl.load(offsets_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    pos = first + tl.arange(0, BT)  # [BT] token index within the span
    offs = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC] channels
    m = offs < channels
    rows = (pos < length)[:, None] & m[None, :]
    x_span = x_ptr + offset * stride_x
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        src = pos - (WIDTH - 1) + j
        xs = tl.load(
            x_span + src[:, None] * stride_x + offs[None, :],
            mask=rows & (src >= 0)[:, None],
            other=0.0,
        )
        acc += tl.load(w_ptr + offs * stride_w + j, mask=m, other=0.0).to(tl.float32)[
            None, :
        ] * xs.to(tl.float32)
    window = state_ptr + slot * stride_slot + offs * stride_channel  # [BC] this slot's columns
    if first == 0:  # the old state: column c is tap t of token c - t
        for c in tl.static_range(WIDTH - 1):
            prev = tl.load(window + c, mask=m, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
            for t in tl.static_range(c + 1):
                tap = tl.load(w_ptr + offs * stride_w + t, mask=m, other=0.0).to(tl.float32)
                acc += tl.where((pos == c - t)[:, None], (tap * prev)[None, :], 0.0)
    # the conv output is rounded to the model dtype first
    y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    out = out_ptr + offset * stride_out + pos[:, None] * stride_out + offs[None, :]
    tl.store(out, (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty), mask=rows)
    if (
        first == 0
    ):  # the new state: inputs length - (WIDTH-1) .. length - 1, read before the barrier
        cols = tl.arange(0, KP)  # [KP] state column
        tail = length - (WIDTH - 1) + cols  # the input it takes, < 0: an old state column
        m_state = m[:, None] & (cols < WIDTH - 1)[None, :]  # [BC, KP]
        x_tail = tl.load(
            x_span + tail[None, :] * stride_x + offs[:, None],
            mask=m_state & (tail >= 0)[None, :],
            other=0.0,
        )
        kept = tl.load(
            window[:, None] + (length + cols)[None, :],
            mask=m_state & (tail < 0)[None, :],
            other=0.0,
        )
        new = tl.where((tail >= 0)[None, :], x_tail, kept.to(x_tail.dtype))
        tl.debug_barrier()  # every thread of the program has read the old state
        tl.store(window[:, None] + cols[None, :], new.to(state_ptr.dtype.element_ty), mask=m_state)


def span_blocks(
    lengths: list[int], block: int, entries: int | None = None
) -> list[tuple[int, int]]:
    """(span, block) of every `block`-token block of the spans, in order: the prefill conv's
    grid and fla's chunk_indices. Padded to `entries` with (last span, 0), which must then
    be an empty span (a CUDA graph's fixed grid)."""
    table = [(i, j) for i, length in enumerate(lengths) for j in range(-(-length // block))]
    if entries is not None:
        if len(table) > entries or (len(table) < entries and (not lengths or lengths[-1] != 0)):
            raise ValueError(
                f"{len(table)} blocks do not pad to {entries} entries ending on an empty span"
            )
        table += [(len(lengths) - 1, 0)] * (entries - len(table))
    return table


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,  # [entries, 2] int32: `span_blocks(lengths, block)`, on the device
    block: int,  # tokens per entry of `blocks`, a power of 2 >= width - 1
    out: torch.Tensor,
) -> None:
    """Triton launch of `causal_conv1d_prefill_reference` (same arguments, plus the block
    table), every span in one kernel: a per-span torch conv costs a cat, a conv and copies per
    span and layer. The grid is the table's, fixed by its size whatever the spans, so a CUDA
    graph can hold it. Spans must not share a slot; rows outside them are untouched."""
    channels, width = _check_conv(x, weight, state, out)
    num = offsets.shape[0]
    check_index("offsets", offsets, num)
    check_index("lengths", lengths, num)
    check_index("slots", slots, num)
    if (
        blocks.dim() != 2
        or blocks.shape[1] != 2
        or blocks.dtype != torch.int32
        or not blocks.is_contiguous()
    ):
        raise ValueError(
            f"blocks: expected [entries, 2] int32, got {tuple(blocks.shape)} {blocks.dtype}"
        )
    if block < width - 1 or block & (block - 1):
        raise ValueError(f"block {block} must be a power of 2 of at least width - 1 = {width - 1}")
    if num == 0 or blocks.shape[0] == 0:
        return
    if x.shape[0] * max(x.stride(0), out.stride(0)) >= 2**31:
        raise ValueError(f"{x.shape[0]} rows overflow the kernel's int32 offsets inside a span")
    block_c = min(64, triton.next_power_of_2(channels))
    grid = (blocks.shape[0], triton.cdiv(channels, block_c))
    _conv_prefill_kernel[grid](
        x,
        weight,
        state,
        offsets,
        lengths,
        slots,
        blocks,
        out,
        x.stride(0),
        weight.stride(0),
        state.stride(0),
        state.stride(1),
        out.stride(0),
        channels,
        WIDTH=width,
        KP=triton.next_power_of_2(width - 1),
        BT=block,
        BC=block_c,
        num_warps=4,
    )
