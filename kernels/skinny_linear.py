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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.kernels.activation import sigmoid_gate, silu_and_mul
from deltaserve.kernels.rmsnorm import add_rms_norm, gated_rms_norm
from deltaserve.kernels.triton_compat import (
    HAS_TRITON,
    INTERPRET,
    check_launchable,
    gpu_path,
    pdl_options,
    tl,
    triton,
    wait_for_previous_grid,
)

# Above this many rows cuBLAS's own tiles stream the weights as fast (tools/bench_linear.py:
# at 64 rows it was as fast or faster on every 4B shape).
MAX_ROWS = 32
HALF_DTYPES = (torch.bfloat16, torch.float16)
SPLIT_BELOW_TILES = 132  # split K when the outputs give fewer 64-row tiles: the H200's SM count


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    evict_first: bool = False  # weights streamed past L2 (read once per step)


# What a kernel does to its input as it reads it (constexpr PROLOGUE): the small op that would
# otherwise be a kernel of its own between a projection and the one before it. Each keeps the
# roundings of its unfused kernel, except ADD_NORM (below).
PLAIN, SILU_MUL, SIGMOID_GATE, GATED_NORM, ADD_NORM = range(5)
# the same, as the kernels see them (a @triton.jit function reads only constexpr globals)
_PLAIN, _SILU_MUL, _SIGMOID_GATE, _GATED_NORM, _ADD_NORM = (tl.constexpr(i) if HAS_TRITON else i for i in range(5))
# the ops `linear` folds into its kernels (tools/bench_step_ab.py turns some off for an A/B)
FOLDED = frozenset({SILU_MUL, SIGMOID_GATE, GATED_NORM, ADD_NORM})


@dataclass(frozen=True)
class InputOp:
    """An op on a projection's input x [M, K] that `linear` folds into the projection.

    SILU_MUL: x is the MLP's [gate | up] [M, 2K]; the input is silu(gate) * up.
    SIGMOID_GATE: x is attention's output; times sigmoid(aux), aux [M, K / hd, hd] strided.
    GATED_NORM: the DeltaNet's per-head gated RMSNorm of x with gate aux (z) [M, K / hd, hd].
    ADD_NORM: the block's pre-norm, rms_norm(x + aux) (aux: the residual); x + aux is
    written to `total`. The kernel sums squares as it walks K and scales the products by
    rsqrt(mean + eps) at the end, so the normalised input is never rounded to the model dtype
    (the unfused norm rounds it once): it needs the whole of K in one program (no split K).
    """

    kind: int
    aux: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    head_dim: int = 1
    total: torch.Tensor | None = None

    def unfused(self, x: torch.Tensor) -> torch.Tensor:
        """The op by its own kernel (or torch reference on the CPU)."""
        rows = x.shape[0]
        if self.kind == SILU_MUL:
            return silu_and_mul(x)
        if self.kind == SIGMOID_GATE:
            return sigmoid_gate(x.view(rows, -1, self.head_dim), self.aux).view(rows, -1)
        if self.kind == GATED_NORM:
            return gated_rms_norm(x.view(rows, -1, self.head_dim), self.aux, self.norm_weight, self.eps).view(rows, -1)
        raise ValueError(f"input op {self.kind} has no unfused form here (add_norm_linear has)")


@triton.jit
def _load_input(x_rows, aux_rows, nw_ptr, ks, mask, up, stride_aux_head, eps,
                PROLOGUE: tl.constexpr, HD: tl.constexpr):
    """The input tile at columns `ks` of the rows at `x_rows` (aux's at `aux_rows`), after the
    PROLOGUE op; _ADD_NORM gives x + residual, the kernel normalises. mask None: the GEMV's row."""
    if mask is None:
        x = tl.load(x_rows + ks)
    else:
        x = tl.load(x_rows + ks, mask=mask, other=0.0)
    if PROLOGUE == _SILU_MUL:
        if mask is None:
            u = tl.load(x_rows + up + ks)
        else:
            u = tl.load(x_rows + up + ks, mask=mask, other=0.0)
        g = x.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(x.dtype).to(tl.float32)
        x = (act * u.to(tl.float32)).to(x.dtype)
    elif PROLOGUE != _PLAIN:
        aux_ptrs = aux_rows + (ks // HD) * stride_aux_head + ks % HD
        if mask is None:
            a = tl.load(aux_ptrs)
        else:
            a = tl.load(aux_ptrs, mask=mask, other=0.0)
        if PROLOGUE == _SIGMOID_GATE:
            act = tl.sigmoid(a.to(tl.float32)).to(a.dtype).to(tl.float32)
            x = (x.to(tl.float32) * act).to(x.dtype)
        elif PROLOGUE == _ADD_NORM:
            x = (x.to(tl.float32) + a.to(tl.float32)).to(x.dtype)
        else:  # _GATED_NORM, as gated_rms_norm rounds: per head of HD columns (whole in the tile)
            xf = tl.reshape(x.to(tl.float32), (x.numel // HD, HD))
            inv = tl.rsqrt(tl.sum(xf * xf, 1) / HD + eps)
            y = (xf * inv[:, None]).to(x.dtype).to(tl.float32)
            w = tl.load(nw_ptr + ks % HD).to(tl.float32) + tl.zeros(x.shape, tl.float32)
            y = (tl.reshape(w, (x.numel // HD, HD)) * y).to(x.dtype).to(tl.float32)
            z = tl.reshape(a.to(tl.float32), (x.numel // HD, HD))
            x = tl.reshape(y * z * tl.sigmoid(z), x.shape).to(x.dtype)
    return x


@triton.jit
def _load_weights(w_ptrs, n_ok, EVICT: tl.constexpr):
    """A weight tile; EVICT: read past L2 (each weight is read once per step)."""
    if EVICT:
        w = tl.load(w_ptrs, mask=n_ok, other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=n_ok, other=0.0)
    return w


@triton.jit
def _skinny_dot_kernel(
    x_ptr, w_ptr, out_ptr, aux_ptr, nw_ptr, sum_ptr,
    M, N, k_per_split, up,
    stride_xm, stride_wn, stride_om, stride_split, stride_aux, stride_aux_head, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    EVICT: tl.constexpr, PROLOGUE: tl.constexpr = _PLAIN, HD: tl.constexpr = 1, GDC: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    k_start = pid_k * k_per_split
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + k_start + offs_k
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    aux_rows = aux_ptr + offs_m[:, None] * stride_aux
    n_ok = offs_n[:, None] < N
    m_ok = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    wait_for_previous_grid(GDC)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k0 + offs_k
        w = _load_weights(w_ptrs, n_ok, EVICT)
        x = _load_input(x_rows, aux_rows, nw_ptr, ks, m_ok, up, stride_aux_head, eps, PROLOGUE, HD)
        if PROLOGUE == _ADD_NORM:  # x is the residual sum: store it once, scale by (1 + w)
            if pid_n == 0:
                tl.store(sum_ptr + offs_m[:, None] * k_per_split + ks, x, mask=m_ok)
            h = x.to(tl.float32)
            squares += tl.sum(h * h, 1)
            x = (h * (1.0 + tl.load(nw_ptr + ks).to(tl.float32))).to(x.dtype)
        if UPCAST:  # the interpreter's bf16 dot is wrong (Triton 3.x); CPU tests only
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(x))
        w_ptrs += BLOCK_K
    if PROLOGUE == _ADD_NORM:
        acc *= tl.rsqrt(squares / k_per_split + eps)[None, :]
    out_ptrs = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, aux_ptr, nw_ptr, sum_ptr,
    N, k_per_split, up,
    stride_wn, stride_split, stride_aux_head, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr,
    PROLOGUE: tl.constexpr = _PLAIN, HD: tl.constexpr = 1, GDC: tl.constexpr = False,
):
    """One row: products summed per thread along K, reduced across threads once at the end."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    n_ok = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    wait_for_previous_grid(GDC)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k0 + offs_k
        w = _load_weights(w_ptrs, n_ok, EVICT)
        x = _load_input(x_ptr, aux_ptr, nw_ptr, ks, None, up, stride_aux_head, eps, PROLOGUE, HD).to(tl.float32)
        if PROLOGUE == _ADD_NORM:  # x is the residual sum: store it once, scale by (1 + w)
            if pid_n == 0:
                tl.store(sum_ptr + ks, x.to(sum_ptr.dtype.element_ty))
            squares += x * x
            x = x * (1.0 + tl.load(nw_ptr + ks).to(tl.float32))
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if PROLOGUE == _ADD_NORM:
        out *= tl.rsqrt(tl.sum(squares, 0) / k_per_split + eps)
    tl.store(out_ptr + pid_k * stride_split + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
    """out = sum over splits in order 0..SPLIT_K-1 (fixed order: deterministic)."""
    wait_for_previous_grid(GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def block_m_for(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    cfg: SkinnyConfig,
    gemv: bool = False,
    out: torch.Tensor | None = None,
    op: InputOp | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T in x's dtype, fp32 accumulation; `out` [M, N] if given.
    With `op`, the product is of op(x), made as x is read (InputOp says what x is)."""
    check_launchable(x, weight)
    m = x.shape[0]
    n, k = weight.shape
    kind = PLAIN if op is None else op.kind
    if x.shape[1] != (2 * k if kind == SILU_MUL else k) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit"
                         + (" (x is [gate | up])" if kind == SILU_MUL else ""))
    if k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"skinny_linear: K={k} is not a multiple of block_k*split_k={cfg.block_k * cfg.split_k}")
    if not fusable(op, cfg):
        raise ValueError(f"skinny_linear: input op {kind} does not fit {cfg}")
    k_per_split = k // cfg.split_k
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"skinny_linear: out must be contiguous [{m}, {n}] {x.dtype}")
    target = out if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    pdl = pdl_options(x)
    aux = norm_weight = total = x  # unused unless the op reads them
    stride_aux = stride_aux_head = 0
    hd, eps = 1, 0.0
    if op is not None and op.aux is not None:
        aux, stride_aux, eps = op.aux, op.aux.stride(0), op.eps
        # aux column of input column c: (c // hd) * stride_aux_head + c % hd
        hd, stride_aux_head = (op.head_dim, op.aux.stride(1)) if op.aux.dim() == 3 else (1, 1)
        norm_weight = op.norm_weight if op.norm_weight is not None else x
        total = op.total if op.total is not None else x
    common = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVICT=cfg.evict_first, PROLOGUE=kind, HD=hd,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if gemv:
        if m != 1:
            raise ValueError("the GEMV kernel takes one row")
        _gemv_kernel[grid](
            x, weight, target, aux, norm_weight, total, n, k_per_split, k, weight.stride(0), m * n,
            stride_aux_head, eps, **common,
        )
    else:
        _skinny_dot_kernel[grid](
            x, weight, target, aux, norm_weight, total, m, n, k_per_split, k,
            x.stride(0), weight.stride(0), n, m * n, stride_aux, stride_aux_head, eps,
            BLOCK_M=block_m_for(m), UPCAST=INTERPRET, **common,
        )
    if cfg.split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target, out, m * n, SPLIT_K=cfg.split_k, BLOCK=block, **pdl
        )
    return out


def fusable(op: InputOp | None, cfg: SkinnyConfig) -> bool:
    """Whether the kernel of `cfg` can make `op` as it reads its input: the pre-norm needs
    all of K in one program, the gated norm whole heads in each tile."""
    if op is None or op.kind not in FOLDED:
        return op is None
    if op.kind == ADD_NORM:
        return cfg.split_k == 1
    if op.kind == GATED_NORM:
        return cfg.block_k % op.head_dim == 0
    return True


def decode_config(rows: int, n: int, k: int) -> tuple[SkinnyConfig, bool] | None:
    """The kernel for `rows` x [n, k], or None for cuBLAS; the rule read off bench_linear's
    sweep at the 4B shapes on the H200 (bench/results/linear_h200_*.json).

    One row: the GEMV; on narrow outputs 4 rows per program over long K slices with 8 warps,
    on wide ones 8 rows per program with the weights evicted from L2 first. More rows: the
    tensor-core kernel with 64-row weight tiles, K split in 3 or 4 only where the outputs give
    fewer tiles than the H200 has SMs (the 2560-wide projections)."""
    if rows == 1:
        if n > 4096:
            return (SkinnyConfig(8, 256, 1, 4, 2, evict_first=True), True) if k % 256 == 0 else None
        block_k = next((b for b in (1024, 512, 256) if k % b == 0), None)
        return (SkinnyConfig(4, block_k, 1, 8, 2), True) if block_k else None
    if rows > MAX_ROWS or k % 128:
        return None
    split = 1
    if triton.cdiv(n, 64) < SPLIT_BELOW_TILES:
        split = next((s for s in (3, 4, 2) if (k // 128) % s == 0), 1)
    return SkinnyConfig(64, 128, split, 4, 3), False


def skinny_choice(x: torch.Tensor, weight: torch.Tensor) -> tuple[SkinnyConfig, bool] | None:
    """The skinny kernel for x W^T (decode_config), or None for cuBLAS."""
    if (
        x.dtype in HALF_DTYPES
        and weight.dtype == x.dtype
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and HAS_TRITON
        and gpu_path(x)
    ):
        return decode_config(x.shape[0], weight.shape[0], weight.shape[1])
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, op: InputOp | None = None) -> torch.Tensor:
    """The model's y = op(x) W^T: the skinny kernels for a decode step's few rows on the GPU,
    making `op` as they read x where it fits; cuBLAS (F.linear) for everything else, after
    the op's own kernel."""
    choice = skinny_choice(x, weight)
    if choice is not None and op is not None and fusable(op, choice[0]):
        return skinny_linear(x, weight, *choice, op=op)
    if op is not None:
        x = op.unfused(x)
    return F.linear(x, weight) if choice is None else skinny_linear(x, weight, *choice)


def add_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(add_rms_norm(x, residual) W^T, x + residual): a block's pre-norm and the projection
    after it, in one kernel on a decode step (InputOp ADD_NORM), else the two kernels."""
    choice = skinny_choice(x, weight)
    if choice is not None:
        op = InputOp(ADD_NORM, residual, norm_weight, eps, total=torch.empty_like(x))
        if fusable(op, choice[0]):
            return skinny_linear(x, weight, *choice, op=op), op.total
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight), total
