"""y = x W^T for decode's few rows: weight-streaming Triton kernels for the GPU path.

A decode step multiplies a handful of rows (1 to max_num_seqs) by every weight matrix, so it
is bound by reading the weights once. cuBLAS picks tiles made for many rows; measured on the
H200 at the 4B shapes it streams the per-layer weights at 62-82% of the copy bandwidth and
adds a split-K reduce launch to the narrow projections. Here each program owns BLOCK_N
output features for all rows and walks a slice of K, so every weight byte is read once by
one program, and the grid is sized to fill the machine (split K only when the outputs alone
give too few programs; the partial sums are then added in a fixed order, never by atomics,
so a result does not depend on scheduling).

The weight tile is the left operand of the tensor-core product (`W_tile @ x_tile^T`): its
BLOCK_N rows fill the MMA's 64-row side and the few token rows its narrow side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.kernels.activation import silu_and_mul, silu_times
from deltaserve.kernels.causal_conv1d import causal_conv1d_update
from deltaserve.kernels.fp8_scales import _x_tile, dequantize, fp8_args
from deltaserve.kernels.triton_compat import (
    H200_SMS,
    HAS_TRITON,
    INTERPRET,
    check_launchable,
    gpu_path,
    pdl_options,
    read_ahead,
    sm_count,
    tl,
    triton,
    wait_for_previous_grid,
)

# The most rows the skinny kernels take (above 32, the
# narrow outputs and TUNED shapes); 0: cuBLAS for all.
MAX_ROWS = 64
HALF_DTYPES = (torch.bfloat16, torch.float16)
ONE_WAVE = True  # the split rule (tools/bench_step_ab.py's "even_splits" mode: the rule before it)
SILU_EPILOGUE = True  # gate_up's kernel makes silu(gate) * up (tools/bench_step_ab.py turns it off)
SUM_IN_NORM = True  # split-K partial sums added by the next norm (`linear(unsummed=True)`; ditto)
USE_TUNED = True  # the TUNED tiles below (tools/bench_step_ab.py's "untuned" mode turns them off)
LM_HEAD_GEMV = True  # one row's logits by the whole-row GEMV (`logits`; ditto, "lm_cublas")
# one row's in_proj GEMV makes the DeltaNet conv (`ConvEpilogue`; ditto, "conv_apart")
CONV_EPILOGUE = True
# the rule's one-row GEMVs read their first K block before the wait (ditto, "rule_plain")
RULE_FIRST_AHEAD = True
# an FP8 weight's GEMV tile: this many times the bf16 tile's rows (one row's replay 2.316 ms against
# 2.376 at 2x and 2.400 at 8x, step_ab_h200_fp8_gemv_rows_4b_b1.json; ditto, "fp8_rows1", ...)
FP8_GEMV_ROWS = 4


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    evict_first: bool = False  # weights streamed past L2 (read once per step)
    whole_rows: bool = False  # GEMV, block_k = K: each program's rows read whole, before the wait
    first_ahead: bool = False  # K-looping GEMV: each program's first K block read before the wait


@dataclass(frozen=True, slots=True)
class SplitSum:
    """x W^T left as its K-split partial sums, for a consumer that adds them in order itself
    (`add_rms_norm`, which the row-parallel projections feed at TP=1): one launch and a
    round trip of the output fewer than `_sum_splits_kernel` then the norm."""

    parts: torch.Tensor  # [splits, M, N] fp32
    dtype: torch.dtype  # of the product: the sum is rounded to it, as `skinny_linear` rounds


@dataclass(frozen=True, slots=True)
class ConvEpilogue:
    """The DeltaNet's causal conv of a decode-only step, after in_proj: the output
    columns below `weight.shape[0]` (the conv channels, [q | k | v]) become what
    `causal_conv1d_update` makes of them, silu(conv(window, x)), and each row's window (its
    slot's) shifts x in; the other columns (z, b, a) stay the product. Row r of the step is
    the item in `slots[r]`, as in a decode-only step (its rows are 0 .. M-1, `rows`).

    One row's whole-row GEMV makes it (width 4) as it writes, the window and taps read ahead of its
    wait: one launch fewer per DeltaNet layer (batch-1 step 2.462 / 2.481 against 2.476 /
    2.484 ms, bench/results/step_ab_h200_conv_epilogue_at_2bf5ebd.json). At 64 rows the
    tensor-core kernel's epilogue measured 2.4% slower, so more rows run the conv kernel."""

    weight: torch.Tensor  # [channels, width] conv taps
    state: torch.Tensor  # [slots, channels, width - 1] the windows, updated in place
    # [M] the step's token rows, 0 .. M-1 (for `causal_conv1d_update` when not fused)
    rows: torch.Tensor
    slots: torch.Tensor  # [M] each row's slot; -1: a padding row, no window touched


@triton.jit
def _conv_inputs(offs, channels, slot, w_ptr, state_ptr, stride_slot):
    """What the conv of output columns `offs` needs besides the product (`ConvEpilogue`): the
    row's window in `slot` (3 inputs a channel, contiguous) and the 4 taps. Read before the
    GEMV's wait: only this kernel writes a decode step's windows."""
    conv = offs < channels
    live = offs < tl.where(slot >= 0, channels, 0)  # the windows to shift: none for a padding row
    window = state_ptr + tl.maximum(slot, 0) * stride_slot + offs * 3
    taps = w_ptr + offs * 4
    return (
        window,
        live,
        read_ahead(window, live, 0.0),
        read_ahead(window + 1, live, 0.0),
        read_ahead(window + 2, live, 0.0),
        read_ahead(taps, conv, 0.0),
        read_ahead(taps + 1, conv, 0.0),
        read_ahead(taps + 2, conv, 0.0),
        read_ahead(taps + 3, conv, 0.0),
    )


@triton.jit
def _conv_output(
    acc, offs, channels, window, live, old0, old1, old2, w0, w1, w2, w3, dtype: tl.constexpr
):
    """acc: fp32 products of columns `offs`; the conv channels' become silu(y), y the taps
    times [window | x] summed in fp32 and rounded to the model dtype, x being the product
    rounded to it (as `causal_conv1d_update` rounds), and their windows shift x in."""
    x = acc.to(dtype)
    y = (
        w0.to(tl.float32) * old0.to(tl.float32)
        + w1.to(tl.float32) * old1.to(tl.float32)
        + w2.to(tl.float32) * old2.to(tl.float32)
        + w3.to(tl.float32) * x.to(tl.float32)
    )
    tl.store(window, old1, mask=live)
    tl.store(window + 1, old2, mask=live)
    tl.store(window + 2, x.to(old0.dtype), mask=live)
    y = y.to(dtype).to(tl.float32)
    return tl.where(offs < channels, y * tl.sigmoid(y), acc)


@triton.jit
def _load_weights(w_ptrs, n_ok, EVICT: tl.constexpr):
    """A weight tile; EVICT: read past L2 (each weight is read once per step)."""
    if EVICT:
        w = tl.load(w_ptrs, mask=n_ok, other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=n_ok, other=0.0)
    return w


@triton.jit
def _weight_rows(pid_n, N, up, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):
    """The program's weight rows and which are real. SILU_MUL: outputs pid_n * BLOCK_N / 2 on,
    their gate rows in the tile's first half and their up rows (`up` rows further) in the
    second, so that the epilogue holds both factors of each output."""
    if SILU_MUL:
        half = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        offs = pid_n * (BLOCK_N // 2) + half
        return offs + (tl.arange(0, BLOCK_N) // (BLOCK_N // 2)) * up, offs < N
    offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs, offs < N


@triton.jit
def _silu_mul_halves(acc, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """[BLOCK_N, BLOCK_M] products of gate rows over up rows -> silu(gate) * up [BLOCK_N / 2,
    BLOCK_M], rounded as the unfused path rounds: each product to the model dtype (the
    gate_up output), silu(gate) to it, then the product (`silu_and_mul`)."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0)))
    return silu_times(gate, up, dtype)


@triton.jit
def _dot(w, x, UPCAST: tl.constexpr, acc=None):
    """w x^T (+ acc): in fp32 at full precision under UPCAST."""
    if UPCAST:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _skinny_dot_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    k_blocks,
    up,
    stride_xm,
    stride_wn,
    stride_om,
    stride_split,
    s_ptr,
    stride_s,
    w_rows,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    EVICT: tl.constexpr,
    SILU_MUL: tl.constexpr = False,
    GDC: tl.constexpr = False,
    FP8: tl.constexpr = False,
    BM: tl.constexpr = 1,
    BN: tl.constexpr = 1,
):
    """SILU_MUL: the weight is [gate | up] by rows (`up` rows each) and out = silu(gate) * up.
    The K split (grid axis 1) gives each part k_blocks / splits of the BLOCK_K blocks, rounded
    down or up, so that a split need not divide them (K = 32 blocks in 3 parts: 10, 11, 11).
    FP8: the weight is FP8 with block scales [BM, BN] (BLOCK_K divides BN): each K block's
    product is scaled by its rows' scales as it is added."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    rows, row_ok = _weight_rows(pid_n, N, up, BLOCK_N, SILU_MUL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    first = pid_k * k_blocks // splits
    k_start = first * BLOCK_K
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    n_ok = row_ok[:, None]
    m_ok = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if FP8:
        s_rows = s_ptr + (tl.minimum(rows, w_rows - 1) // BM) * stride_s
    wait_for_previous_grid(GDC)
    for block in range(first, (pid_k + 1) * k_blocks // splits):
        w = _load_weights(w_ptrs, n_ok, EVICT)
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong (Triton 3.x); CPU tests only
            w, x = w.to(tl.float32), x.to(tl.float32)
        if FP8:  # the weight widened to x's dtype (exact: bf16 and fp16 hold every FP8 value)
            acc += _dot(w.to(x.dtype), x, UPCAST) * tl.load(s_rows + block * BLOCK_K // BN)[:, None]
        else:
            acc = _dot(w, x, UPCAST, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SILU_MUL:
        acc = _silu_mul_halves(acc, out_ptr.dtype.element_ty, BLOCK_N, BLOCK_M)
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(
        out_ptrs,
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m[None, :] < M) & (offs_n[:, None] < N),
    )


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    k_per_split,
    up,
    stride_wn,
    stride_split,
    conv_channels,
    conv_w_ptr,
    conv_state_ptr,
    conv_slots_ptr,
    stride_conv_slot,
    s_ptr,
    stride_s,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVICT: tl.constexpr,
    SILU_MUL: tl.constexpr = False,
    TAIL_K: tl.constexpr = -1,
    CONV: tl.constexpr = False,
    GDC: tl.constexpr = False,
    FIRST_AHEAD: tl.constexpr = False,
    FP8: tl.constexpr = False,
    BM: tl.constexpr = 1,
    BN: tl.constexpr = 1,
):
    """One row: products summed per thread along K, reduced across threads once at the end.
    SILU_MUL as in `_skinny_dot_kernel`; CONV (whole rows only): the DeltaNet conv over the first
    conv_channels outputs (`ConvEpilogue`). TAIL_K >= 0: the program's rows are BLOCK_K + TAIL_K
    wide (no K split; TAIL_K 0 or a power of two) and read whole before the wait, so that a
    program launched while the previous kernel finishes streams its weights meanwhile.
    FIRST_AHEAD (the K loop): the first K block so, the rest after the wait. FP8: the weight is
    FP8 with block scales [BM, BN]; a tile's rows lie in one row block (two with SILU_MUL, its
    halves), so x is scaled once per row block (`_x_tile`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows, row_ok = _weight_rows(pid_n, N, up, BLOCK_N, SILU_MUL)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    lo_row = pid_n * (BLOCK_N // 2) if SILU_MUL else pid_n * BLOCK_N
    s_lo, s_hi = (lo_row // BM) * stride_s, ((lo_row + up) // BM) * stride_s
    hi = tl.arange(0, BLOCK_N) >= BLOCK_N // 2
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + k_start + offs_k
    n_ok = row_ok[:, None]
    if TAIL_K >= 0:
        if CONV:
            conv_in = _conv_inputs(
                pid_n * BLOCK_N + tl.arange(0, BLOCK_N),
                conv_channels,
                read_ahead(conv_slots_ptr).to(tl.int64),
                conv_w_ptr,
                conv_state_ptr,
                stride_conv_slot,
            )
        w = _load_weights(w_ptrs, n_ok, EVICT)
        if TAIL_K > 0:
            w_tail = _load_weights(
                w_ptr + rows[:, None] * stride_wn + (BLOCK_K + tl.arange(0, TAIL_K))[None, :],
                n_ok,
                EVICT,
            )
        wait_for_previous_grid(GDC)
        x = _x_tile(tl.load(x_ptrs), offs_k, hi, s_ptr, s_lo, s_hi, FP8, BN, SILU_MUL)
        out = tl.sum(w.to(tl.float32) * x, axis=1)
        if TAIL_K > 0:
            tail_k = BLOCK_K + tl.arange(0, TAIL_K)
            x_tail = _x_tile(
                tl.load(x_ptr + tail_k), tail_k, hi, s_ptr, s_lo, s_hi, FP8, BN, SILU_MUL
            )
            out += tl.sum(w_tail.to(tl.float32) * x_tail, axis=1)
    else:
        if FIRST_AHEAD:
            w = _load_weights(w_ptrs, n_ok, EVICT)
            wait_for_previous_grid(GDC)
            acc = w.to(tl.float32) * _x_tile(
                tl.load(x_ptrs), k_start + offs_k, hi, s_ptr, s_lo, s_hi, FP8, BN, SILU_MUL
            )
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            first = BLOCK_K
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            wait_for_previous_grid(GDC)
            first = 0
        for k in range(first, k_per_split, BLOCK_K):
            w = _load_weights(w_ptrs, n_ok, EVICT)
            x = _x_tile(
                tl.load(x_ptrs), k_start + k + offs_k, hi, s_ptr, s_lo, s_hi, FP8, BN, SILU_MUL
            )
            acc += w.to(tl.float32) * x
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)
    if SILU_MUL:
        out = tl.reshape(
            _silu_mul_halves(tl.reshape(out, (BLOCK_N, 1)), out_ptr.dtype.element_ty, BLOCK_N, 1),
            (BLOCK_N // 2,),
        )
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if CONV:
            window, live, old0, old1, old2, w0, w1, w2, w3 = conv_in
            out = _conv_output(
                out,
                offs_n,
                conv_channels,
                window,
                live,
                old0,
                old1,
                old2,
                w0,
                w1,
                w2,
                w3,
                out_ptr.dtype.element_ty,
            )
    tl.store(
        out_ptr + pid_k * stride_split + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N
    )


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = False
):
    """out = sum over splits in order 0..SPLIT_K-1 (fixed order: deterministic)."""
    wait_for_previous_grid(GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _check_conv_epilogue(
    conv: ConvEpilogue,
    m: int,
    n: int,
    cfg: SkinnyConfig,
    gemv: bool,
    silu_mul: bool,
    out: torch.Tensor | None,
    dtype: torch.dtype,
) -> None:
    channels = conv.weight.shape[0]
    if conv.weight.shape != (channels, 4) or not conv.weight.is_contiguous() or channels > n:
        raise ValueError(
            f"conv epilogue: taps must be contiguous [channels <= {n}, 4], "
            f"got {tuple(conv.weight.shape)}"
        )
    if (
        conv.state.dim() != 3
        or conv.state.shape[1:] != (channels, 3)
        or conv.state.stride()[1:] != (3, 1)
    ):
        raise ValueError(
            f"conv epilogue: windows must be [slots, {channels}, 3] contiguous per slot, got "
            f"{tuple(conv.state.shape)} strides {conv.state.stride()}"
        )
    if conv.slots.shape != (m,) or conv.slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"conv epilogue: slots must be [{m}] int32/int64, "
            f"got {tuple(conv.slots.shape)} {conv.slots.dtype}"
        )
    if not (gemv and cfg.whole_rows) or silu_mul or (out is not None and out.dtype != dtype):
        raise ValueError(
            f"conv epilogue: needs the whole-row GEMV ({cfg}), no silu_mul and out in x's dtype"
        )


def whole_row_parts(k: int) -> tuple[int, int] | None:
    """A row of K read whole in two power-of-two parts (the second 0 where K is a power of two),
    or None where K is no sum of two powers of two."""
    head = 1 << (k.bit_length() - 1)
    tail = k - head
    return None if tail & (tail - 1) else (head, tail)


def splits_fit(k: int, block_k: int, split_k: int, gemv: bool) -> bool:
    """Whether K splits into `split_k` parts of whole blocks: equal parts for the GEMV, parts
    that may differ by a block for the tensor-core kernel."""
    return k % (block_k * (split_k if gemv else 1)) == 0 and split_k <= k // block_k


def block_m_for(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    cfg: SkinnyConfig,
    gemv: bool = False,
    out: torch.Tensor | None = None,
    silu_mul: bool = False,
    unsummed: bool = False,
    conv: ConvEpilogue | None = None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] = (1, 1),
) -> torch.Tensor | SplitSum:
    """x [M, K] @ weight[N, K]^T in x's dtype (or fp32 into an fp32 `out`), fp32 accumulation;
    `out` [M, N] if given.
    With `unsummed` and K split, the partial sums as a `SplitSum` instead.
    With `silu_mul`, weight is the MLP's [gate | up] [2 I, K] and the result silu(gate) * up
    [M, I], made in the kernel's epilogue (`silu_and_mul` of the product, bit for bit).
    With `conv`, the DeltaNet conv over the first columns, in the epilogue (`ConvEpilogue`).
    With `scale`, weight is FP8 and `scale` its [ceil(N / bm), ceil(K / bn)] block scales for
    `block` (bm, bn) (engine/rank/fp8.py)."""
    check_launchable(x, weight)
    m = x.shape[0]
    rows, k = weight.shape
    n = rows // 2 if silu_mul else rows
    if x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit"
        )
    if not splits_fit(k, cfg.block_k, cfg.split_k, gemv):
        raise ValueError(
            f"skinny_linear: K={k} does not split into {cfg.split_k} parts of whole blocks of "
            f"{cfg.block_k}" + (" (the GEMV's parts alike)" if gemv else "")
        )
    if (cfg.whole_rows or cfg.first_ahead) and not gemv:
        raise ValueError(
            f"skinny_linear: whole rows and the first block read ahead are the GEMV's ({cfg})"
        )
    if cfg.whole_rows and cfg.first_ahead:
        raise ValueError(
            f"skinny_linear: whole rows are read ahead whole, not by their first block ({cfg})"
        )
    if silu_mul and (
        rows % 2
        or cfg.split_k != 1
        or cfg.block_n < 2
        or (out is not None and out.dtype != x.dtype)
    ):
        raise ValueError(
            f"skinny_linear: silu_mul needs an even [gate | up] weight (got {rows} rows), "
            f"no K split, at least 2 rows per tile ({cfg}) and out in x's dtype"
        )
    if conv is not None:
        _check_conv_epilogue(conv, m, n, cfg, gemv, silu_mul, out, x.dtype)
    fp8 = fp8_args(
        weight, scale, block, scale is None or fp8_fits(cfg, gemv, block, silu_mul, rows), cfg
    )
    conv_args = (
        (conv.weight.shape[0], conv.weight, conv.state, conv.slots, conv.state.stride(0))
        if conv
        else (0, x, x, x, 0)
    )
    k_per_split = k // cfg.split_k
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif (
        out.shape != (m, n) or out.dtype not in (x.dtype, torch.float32) or not out.is_contiguous()
    ):
        raise ValueError(f"skinny_linear: out must be contiguous [{m}, {n}] {x.dtype} or fp32")
    target = (
        out
        if cfg.split_k == 1
        else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    )
    outputs_per_tile = cfg.block_n // 2 if silu_mul else cfg.block_n
    grid = (triton.cdiv(n, outputs_per_tile), cfg.split_k)
    pdl = pdl_options(x, kind="gemv" if gemv else "dot")
    if gemv:
        if m != 1:
            raise ValueError("the GEMV kernel takes one row")
        block_k, tail_k = cfg.block_k, -1  # -1: the K loop
        if cfg.whole_rows:
            parts = whole_row_parts(k)
            if cfg.block_k != k or parts is None:
                raise ValueError(
                    f"skinny_linear: whole rows need block_k = K and K a sum of two powers "
                    f"of two; K={k}, {cfg}"
                )
            block_k, tail_k = parts
        _gemv_kernel[grid](
            x,
            weight,
            target,
            n,
            k_per_split,
            n,
            weight.stride(0),
            m * n,
            *conv_args,
            *fp8.pointers[:2],
            BLOCK_N=cfg.block_n,
            BLOCK_K=block_k,
            EVICT=cfg.evict_first,
            SILU_MUL=silu_mul,
            TAIL_K=tail_k,
            CONV=conv is not None,
            FIRST_AHEAD=cfg.first_ahead,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **fp8.flags,
            **pdl,
        )
    else:
        _skinny_dot_kernel[grid](
            x,
            weight,
            target,
            m,
            n,
            k // cfg.block_k,
            n,
            x.stride(0),
            weight.stride(0),
            n,
            m * n,
            *fp8.pointers,
            BLOCK_M=block_m_for(m),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            UPCAST=INTERPRET,
            EVICT=cfg.evict_first,
            SILU_MUL=silu_mul,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **fp8.flags,
            **pdl,
        )
    if cfg.split_k > 1 and unsummed:
        return SplitSum(target, x.dtype)
    if cfg.split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target, out, m * n, SPLIT_K=cfg.split_k, BLOCK=block, **pdl
        )
    return out


# Tiles for the 4B, 9B and 2B shapes by (most rows, N, K): each was the fastest inside the decode
# step on the H200, by the projection's share of the step's critical path, and the whole step's
# replay was faster with them (tools/step_tiles.py, bench/results/step_tiles_h200_*.json). Beside
# each: its share against the general rule's (or cuBLAS's, above 32 rows), per step, in us.
TUNED = {
    # one row, whole rows read before the wait (replay 2.597 against 2.641 ms,
    # step_ab_h200_gemv_whole_rows_adopted_at_180c95a.json; for down or qkv: slower)
    # DeltaNet in_proj: 351 against 430
    (1, 12352, 2560): SkinnyConfig(2, 2560, 1, 4, 1, whole_rows=True),
    # MLP gate_up + silu epilogue: 748 against 766
    (1, 18432, 2560): SkinnyConfig(2, 2560, 1, 2, 1, whole_rows=True),
    # MLP down: 2 rows a program, its first block read before the wait (replay -1.0% with the rule's
    # one-row GEMVs so, step_ab_h200_first_block_ahead_down_tiles_4b_b1_at_7e91d54.json)
    (1, 2560, 9216): SkinnyConfig(2, 1024, 1, 4, 2, evict_first=True, first_ahead=True),
    # out/o_proj so too: 2.407 against the rule's 4 rows and 8 warps, 2.415 ms
    # (step_ab_h200_4b_b1_o2x1024_confirm_at_a752d10.json; whole rows 2.433)
    (1, 2560, 4096): SkinnyConfig(2, 1024, 1, 4, 2, first_ahead=True),
    # (out/o_proj and down at 2-64 rows, K in 3 parts, are the rule's: one wave of 120 programs)
    (64, 12352, 2560): SkinnyConfig(64, 64, 1, 4, 5),  # DeltaNet in_proj: 453 against cuBLAS's 482
    # MLP gate_up + silu epilogue: step 5.467 ms against cuBLAS's 5.542
    (64, 18432, 2560): SkinnyConfig(64, 64, 1, 4, 4),
    # 9B (hidden 4096; step_tiles_h200_9b_at_01e2744.json). One row: every projection reads its
    # rows whole before the wait (replay 4.154 against the rule's 4.457 ms), down's K of 12288 too
    # in_proj: 587 against 696
    (1, 12352, 4096): SkinnyConfig(2, 4096, 1, 4, 1, evict_first=True, whole_rows=True),
    # gate_up + silu epilogue: 1458 against 1670
    (1, 24576, 4096): SkinnyConfig(4, 4096, 1, 8, 1, whole_rows=True),
    (1, 4096, 12288): SkinnyConfig(2, 12288, 1, 4, 1, whole_rows=True),  # down: 779 against 843
    # attention qkv: 148 against 164
    (1, 10240, 4096): SkinnyConfig(2, 4096, 1, 4, 1, whole_rows=True),
    (1, 4096, 4096): SkinnyConfig(4, 4096, 1, 8, 1, whole_rows=True),  # out/o_proj: 296 against 342
    # down: 825 against 1016 at 8 rows (the rule's 2 parts: 835)
    (32, 4096, 12288): SkinnyConfig(64, 128, 3, 4, 4),
    # 2B (hidden 2048). One row: whole rows again (replay 1.280 against 1.312 ms,
    # step_ab_h200_2b_one_wave_at_01e2744-onewave.json; the shares from step_tiles at 01e2744)
    (1, 8224, 2048): SkinnyConfig(2, 2048, 1, 2, 1, whole_rows=True),  # in_proj: 168 against 182
    # gate_up + silu epilogue: 307 against 381
    (1, 12288, 2048): SkinnyConfig(2, 2048, 1, 2, 1, whole_rows=True),
    (1, 2048, 6144): SkinnyConfig(4, 6144, 1, 8, 1, whole_rows=True),  # down: 157 against 185
    # attention qkv: 28 against 48
    (1, 5120, 2048): SkinnyConfig(2, 2048, 1, 4, 1, whole_rows=True),
    (1, 2048, 2048): SkinnyConfig(2, 2048, 1, 4, 1, whole_rows=True),  # out/o_proj: 57 against 85
}


def tuned_class(rows: int) -> int:
    """The row class TUNED keys `rows` by: 1, up to 32, up to 64 (0: none)."""
    return 1 if rows == 1 else 32 if rows <= 32 else 64 if rows <= 64 else 0


def decode_config(
    rows: int, n: int, k: int, sms: int = H200_SMS
) -> tuple[SkinnyConfig, bool] | None:
    """The kernel for `rows` x [n, k], or None for cuBLAS: a TUNED tile, else the rule read
    off the sweeps at the 0.8B-9B shapes on the H200 (bench/results/step_tiles_h200_*.json).

    One row: the GEMV; on narrow outputs 4 rows per program over long K slices with 8 warps,
    on wide ones 8 rows per program with the weights evicted from L2 first; each program's first
    K block read before the wait (the 0.8B's replay -3.7%,
    step_ab_h200_rule_first_block_ahead_0.8b_b1_at_7e91d54.json). More rows: the
    tensor-core kernel with 64-row weight tiles; where the outputs give fewer tiles than the
    GPU has SMs (`sms`), K split into as many parts (whole blocks, differing by one at most) as
    fill one wave of one program per SM, and up to 32 rows unsplit; else cuBLAS.

    The split rule came from the 4B's 2560-wide projections: 40 tiles, K in 3 parts differing
    by a block, 120 programs (out/o_proj: replay -1.2% at 8 rows and -2.1% at 32 against 4 even
    parts, step_ab_h200_out_proj_uneven_split_32_rows_at_3f0861e.json; at 64 rows 5.343 against
    cuBLAS's 5.411 ms, step_ab_h200_out_proj_uneven_split_at_169eb6c.json; down: 472 / 480 us a
    step against 513 / 589 at 8 / 32 rows, 505 against cuBLAS's 558 at 64); the 0.8B, 2B and 9B
    sweeps picked the same fill (step_tiles_h200_{0.8b,2b,9b}_*.json)."""
    most = tuned_class(rows)
    if USE_TUNED and (most, n, k) in TUNED:
        return TUNED[most, n, k], rows == 1
    if rows == 1:
        if n > 4096:
            wide = SkinnyConfig(8, 256, 1, 4, 2, evict_first=True, first_ahead=RULE_FIRST_AHEAD)
            return (wide, True) if k % 256 == 0 else None
        block_k = next((b for b in (1024, 512, 256) if k % b == 0), None)
        return (
            (SkinnyConfig(4, block_k, 1, 8, 2, first_ahead=RULE_FIRST_AHEAD), True)
            if block_k
            else None
        )
    if k % 128:
        return None
    if not ONE_WAVE:  # splits that divide K's blocks, up to 32 rows
        split = (
            next((s for s in (3, 4, 2) if (k // 128) % s == 0), 1)
            if triton.cdiv(n, 64) < sms
            else 1
        )
        return None if rows > 32 else (SkinnyConfig(64, 128, split, 4, 3), False)
    split = max(1, min(sms // triton.cdiv(n, 64), k // 128))
    if split == 1 and rows > 32:
        return None
    return SkinnyConfig(64, 128, split, 4, 3 if split == 1 else 4), False


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    silu_mul: bool = False,
    unsummed: bool = False,
    conv: ConvEpilogue | None = None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] = (1, 1),
) -> torch.Tensor | SplitSum:
    """The model's y = x W^T: the skinny kernels for a decode step's few rows on the GPU,
    cuBLAS (F.linear) for everything else. With `silu_mul`, W is the MLP's [gate | up] and
    y = silu_and_mul(x W^T), made by the skinny kernels' epilogue (SILU_EPILOGUE), else by
    `silu_and_mul` after the product. With `unsummed`, a K-split product comes back as its
    partial sums (`SplitSum`, for `add_rms_norm`; SUM_IN_NORM). With `conv` (the GPU path
    only), the DeltaNet conv over the first columns: in the whole-row GEMV's epilogue
    (CONV_EPILOGUE; one row, width 4), else by `causal_conv1d_update` after the product.
    With `scale`, W is FP8 with these block scales: the skinny kernels read it as it is, any
    other path widens it first (`dequantize`)."""
    if (
        x.dtype in HALF_DTYPES
        and (weight.dtype == x.dtype or scale is not None)
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and HAS_TRITON
        and gpu_path(x)
    ):
        choice = decode_config(x.shape[0], weight.shape[0], weight.shape[1], sm_count(x))
        if choice is not None and scale is not None and choice[1]:
            choice = dataclasses.replace(choice[0], block_n=choice[0].block_n * FP8_GEMV_ROWS), True
        if choice is not None and (
            scale is None or fp8_fits(choice[0], choice[1], block, silu_mul, weight.shape[0])
        ):
            cfg, gemv = choice
            fp8 = {"scale": scale, "block": block}
            if conv is not None:
                if CONV_EPILOGUE and gemv and cfg.whole_rows and conv.weight.shape[1] == 4:
                    return skinny_linear(x, weight, cfg, gemv, conv=conv, **fp8)
                return _conv_after(skinny_linear(x, weight, cfg, gemv, **fp8), conv)
            if silu_mul and SILU_EPILOGUE and cfg.split_k == 1:
                return skinny_linear(x, weight, cfg, gemv, silu_mul=True, **fp8)
            y = skinny_linear(
                x, weight, cfg, gemv, unsummed=unsummed and SUM_IN_NORM and not silu_mul, **fp8
            )
            return silu_and_mul(y) if silu_mul else y
    if scale is not None:
        weight = dequantize(weight, scale, block).to(x.dtype)
    if conv is not None:
        return _conv_after(F.linear(x, weight), conv)
    y = F.linear(x, weight)
    return silu_and_mul(y) if silu_mul else y


def fp8_fits(
    cfg: SkinnyConfig, gemv: bool, block: tuple[int, int], silu_mul: bool, rows: int
) -> bool:
    """Whether the kernel's tiles can read FP8 weights
    of these blocks (`fp8_args` refuses the others)."""
    bm, bn = block
    tile_rows = cfg.block_n // 2 if silu_mul else cfg.block_n
    k_parts = (whole_row_parts(cfg.block_k) or (1, 1)) if cfg.whole_rows else (cfg.block_k, 0)
    fits = (
        bm % tile_rows == 0 and not any(part % bn for part in k_parts)
        if gemv
        else bn % cfg.block_k == 0
    )
    return fits and not (silu_mul and (rows // 2) % bm)


def _conv_after(y: torch.Tensor, conv: ConvEpilogue) -> torch.Tensor:
    """`ConvEpilogue` by its own kernel, in place over y's conv channels."""
    channels = y[:, : conv.weight.shape[0]]
    causal_conv1d_update(channels, conv.weight, conv.state, conv.rows, conv.slots, channels)
    return y


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x W^T of the lm_head, on CUDA from the fp32 accumulator (a bf16 output would round a
    logit of 20 to a step of 0.125, an error of ~0.03 nat before any layer is wrong). One row
    in a half dtype: the GEMV on whole rows (K a sum of two powers of two, at most 4096: two
    rows per program stay in registers), launched with PDL where cuBLAS is not, and measured
    faster than cuBLAS's GEMM at the 4B shapes on the H200; else that GEMM."""
    k = weight.shape[1]
    if (
        LM_HEAD_GEMV
        and x.shape[0] == 1
        and k <= 4096
        and whole_row_parts(k)
        and x.dtype in HALF_DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == weight.stride(1) == 1
        and HAS_TRITON
        and gpu_path(x)
    ):
        out = torch.empty((1, weight.shape[0]), dtype=torch.float32, device=x.device)
        return skinny_linear(
            x, weight, SkinnyConfig(2, k, 1, 4, 1, whole_rows=True), gemv=True, out=out
        )
    if x.is_cuda and x.dtype != torch.float32:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x, weight).float()
