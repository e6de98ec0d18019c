"""The routed experts of a mixture-of-experts MLP: each token's top-k experts' SwiGLU MLPs,
summed with the router's weights.

The reference (the CPU path) runs each expert that any token chose over its tokens, as HF's
`Qwen3_5MoeExperts` does. The GPU path must fit a CUDA graph, so nothing may depend on the
routing on the host. One program a token picks its top k (`_route_kernel`). A few tokens
(up to GEMV_PAIRS (token, expert) pairs) run per-pair GEMVs on CUDA cores: gate and up rows
together, then one program per (token, output rows) adds its k experts' down products and the
shared expert's in one write (`experts_and_shared`). More tokens are grouped: `group_pairs`
orders the pairs by expert into blocks of `block_m` rows, padded, with fixed-size tensor ops
(vLLM's moe_align_block_size idea; the block count is bounded by the pair count alone), and a
tensor-core kernel per product runs every block against its expert's weight tile
(`_expert_product_kernel`); the k rows of a token are added in order afterwards, so the result
never depends on which block finished first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.activation import silu_and_mul_reference, silu_times, times_sigmoid
from deltaserve.kernels.triton_compat import (
    HAS_TRITON,
    INTERPRET,
    check_launchable,
    gpu_path,
    pdl_options,
    sm_count,
    tl,
    triton,
    wait_for_previous_grid,
)


def route_reference(
    logits: torch.Tensor, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) from router logits [T, E]: softmax in fp32,
    the top k, renormalised to sum to 1 and rounded to the model dtype (HF's
    Qwen3_5MoeTopKRouter)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(dtype).float(), ids


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    num_experts,
    TOP_K: tl.constexpr,
    BE: tl.constexpr,
    BF16: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # program: one token's router logits -> its top-k experts (best first) and their weights
    wait_for_previous_grid(GDC)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BE)
    logits = tl.load(
        logits_ptr + t * stride_logits + offs, mask=offs < num_experts, other=float("-inf")
    )
    probs = tl.exp(logits.to(tl.float32) - tl.max(logits.to(tl.float32), axis=0))
    probs = probs / tl.sum(probs, axis=0)
    # a row of NaN logits (a graph's padding row may hold anything) picks experts 0..k-1
    probs = tl.where(probs == probs, probs, 0.0)
    total = 0.0
    left = probs
    for _ in tl.static_range(TOP_K):  # the top k's sum; the same picks again below, stored
        best = tl.max(left, axis=0)
        total += best
        left = tl.where(offs == tl.argmax(left, axis=0, tie_break_left=True), -1.0, left)
    left = probs
    for k in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        index = tl.argmax(left, axis=0, tie_break_left=True)
        weight = best / total
        if BF16:  # the weights in the model dtype, as HF's router returns them
            weight = weight.to(tl.bfloat16).to(tl.float32)
        tl.store(ids_ptr + t * TOP_K + k, index.to(tl.int64))
        tl.store(weights_ptr + t * TOP_K + k, weight)
        left = tl.where(offs == index, -1.0, left)


def route(
    logits: torch.Tensor, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference`: one Triton program a token on the GPU path."""
    if not (gpu_path(logits) and HAS_TRITON):
        return route_reference(logits, top_k, dtype)
    check_launchable(logits)
    tokens, num_experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits,
            weights,
            ids,
            logits.stride(0),
            num_experts,
            TOP_K=top_k,
            BE=triton.next_power_of_2(num_experts),
            BF16=dtype == torch.bfloat16,
            num_warps=1 if num_experts <= 256 else 4,
            **pdl_options(logits),
        )
    return weights, ids


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k weights[t, k] * down[e] (silu(gate[e] x_t) * up[e] x_t) over e = ids[t, k], in fp32
    [T, H]. gate_up [E, 2 I, H] (gate rows then up rows), down [E, H, I]; products in x's dtype."""
    out = torch.zeros((x.shape[0], down.shape[1]), dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        h = silu_and_mul_reference(F.linear(x[tokens], gate_up[expert]))
        y = F.linear(h, down[expert]).float() * weights[tokens, slots, None]
        out.index_add_(0, tokens, y)
    return out


def group_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [blocks * block_m] int32, block_expert [blocks] int32) for ids [T, k].

    Pair p is (token p // k, its (p % k)-th expert). Each expert's pairs fill whole blocks of
    `block_m` rows in token order, padded with -1; block b holds expert block_expert[b]'s, and
    blocks past the last used one have expert -1. Shapes depend on T, k, E and block_m only."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    blocks = min(num_pairs, -(-num_pairs // block_m) + min(num_experts, num_pairs))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    expert_blocks = (counts + block_m - 1) // block_m
    block_end = expert_blocks.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pairs by expert, token order kept
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[by_expert]
    pairs = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=ids.device)
    pairs[(block_end - expert_blocks)[by_expert] * block_m + rank] = order.to(torch.int32)
    index = torch.arange(blocks, device=ids.device)
    block_expert = torch.searchsorted(block_end, index, right=True)
    return pairs, torch.where(index < block_end[-1], block_expert, -1).to(torch.int32)


@triton.jit
def _expert_product_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    weights_ptr,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    n_out,
    k_in,
    up_offset,
    ROWS_PER_PAIR: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GATE_UP: tl.constexpr,
    EXACT: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # program: block b of pairs (one expert) x BN output features.
    # GATE_UP: input row = the pair's token (pair // ROWS_PER_PAIR), out = silu(x Wg^T) * (x Wu^T)
    # in the model dtype; else input row = the pair, out = (x W^T) * weight[pair] in fp32.
    wait_for_previous_grid(GDC)
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b)
    if expert < 0:
        return
    offs_m = tl.arange(0, BM)
    pairs = tl.load(pairs_ptr + b * BM + offs_m)
    valid = pairs >= 0
    rows = tl.where(valid, pairs // ROWS_PER_PAIR if GATE_UP else pairs, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < n_out
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, k_in, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < k_in
        a = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=valid[:, None] & mk[None, :],
            other=0.0,
        )
        w = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        if EXACT:  # fp32 model (or the interpreter, whose bf16 dot is wrong)
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
        if GATE_UP:
            u = tl.load(
                w_rows + up_offset * stride_wn + offs_k[None, :],
                mask=mn[:, None] & mk[None, :],
                other=0.0,
            )
            if EXACT:
                acc_up += tl.dot(
                    a.to(tl.float32), tl.trans(u.to(tl.float32)), input_precision="ieee"
                )
            else:
                acc_up += tl.dot(a, tl.trans(u))
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        result = silu_times(acc, acc_up, dtype)
    else:
        result = acc * tl.load(weights_ptr + tl.where(valid, pairs, 0))[:, None]
    out_ptrs = (
        out_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    )
    tl.store(out_ptrs, result.to(dtype), mask=valid[:, None] & mn[None, :])


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    n_out,
    k_in,
    TOP_K: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # program: one (token, expert) pair x BN of its expert's gate rows and the matching up rows,
    # products on CUDA cores: with a few tokens each pair reads its expert's rows once, and
    # nothing is grouped. out = silu(x Wg^T) * (x Wu^T), rounded as `silu_times` rounds.
    wait_for_previous_grid(GDC)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < n_out
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BN], tl.float32)
    acc_up = tl.zeros([BN], tl.float32)
    for k0 in range(0, k_in, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < k_in
        x = tl.load(x_ptr + (pair // TOP_K) * stride_x + offs_k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        u = tl.load(
            w_rows + n_out * stride_wn + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0
        )
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        acc_up += tl.sum(u.to(tl.float32) * x[None, :], axis=1)
    result = silu_times(acc, acc_up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + pair * stride_out + offs_n, result.to(out_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _row_dot(x_ptr, w_rows, mn, k_in, BK: tl.constexpr, BN: tl.constexpr):
    """sum over k of w[n, k] x[k] for the BN rows at w_rows, in fp32."""
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, k_in, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < k_in
        x = tl.load(x_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc


@triton.jit
def _down_sum_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    shared_h_ptr,
    shared_w_ptr,
    shared_gate_ptr,
    out_ptr,
    stride_h,
    stride_we,
    stride_wn,
    stride_shared_h,
    stride_shared_wn,
    stride_gate,
    stride_out,
    n_out,
    k_in,
    k_shared,
    TOP_K: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SHARED: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # program: one token x BN output features: sum over its k experts of weight * (h W_down^T),
    # plus, with SHARED, sigmoid(shared gate) * (shared h W_shared_down^T) rounded to the dtype
    # (as HF's shared expert's output is); one write in `out`'s dtype.
    wait_for_previous_grid(GDC)
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < n_out
    rows = offs_n[:, None].to(tl.int64)
    acc = tl.zeros([BN], tl.float32)
    for j in range(TOP_K):
        pair = t * TOP_K + j
        expert = tl.load(ids_ptr + pair)
        part = _row_dot(
            h_ptr + pair * stride_h, w_ptr + expert * stride_we + rows * stride_wn, mn, k_in, BK, BN
        )
        acc += part * tl.load(weights_ptr + pair)
    dtype = out_ptr.dtype.element_ty
    if SHARED:
        part = _row_dot(
            shared_h_ptr + t * stride_shared_h,
            shared_w_ptr + rows * stride_shared_wn,
            mn,
            k_shared,
            BK,
            BN,
        )
        acc += times_sigmoid(part.to(dtype), tl.load(shared_gate_ptr + t * stride_gate))
    tl.store(out_ptr + t * stride_out + offs_n, acc.to(dtype), mask=mn)


# Up to this many (token, expert) pairs a step, each pair reads its expert's rows itself
# (`_gate_up_gemv_kernel`, `_down_sum_kernel`); past it the pairs are grouped by expert and
# each expert is read once (`_expert_product_kernel`). On an H100 at 35B-A3B's shapes the
# GEMVs won up to 32 tokens (256 pairs: 406 against 441 us a layer) and lost at 64
# (bench/results/moe_kernels_h100_at_594b39e.json).
GEMV_PAIRS = 256
GEMV_COLUMNS = 128  # columns of a GEMV program's weight tile


def gemv_rows(total_rows: int, sms: int) -> int:
    """Rows of a GEMV program's tile: 16, or fewer (down to 4) until there are programs for
    four per SM (one token's down product has only H / 16 = 128 programs of 16 rows)."""
    rows = 16
    while rows > 4 and total_rows // rows < 4 * sms:
        rows //= 2
    return rows


def _block_m(num_pairs: int) -> int:
    return 16 if num_pairs <= 512 else 64


def _check_shapes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    num_experts, hidden, inter = down.shape
    if (
        gate_up.shape != (num_experts, 2 * inter, x.shape[1])
        or hidden != x.shape[1]
        or x.stride(1) != 1
    ):
        raise ValueError(
            f"experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down "
            f"{tuple(down.shape)} do not fit [T, H], [E, 2 I, H], [E, H, I]"
        )


def experts_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """`experts_reference` (same arguments; weights fp32): per-pair GEMVs up to GEMV_PAIRS
    pairs (`experts_and_shared`), else two grouped products and the sum over k."""
    check_launchable(x, gate_up, down)
    _check_shapes(x, gate_up, down)
    tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    top_k = ids.shape[1]
    if tokens * top_k <= GEMV_PAIRS:
        return experts_and_shared(x, gate_up, down, weights, ids, torch.float32)
    out = torch.empty((tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).contiguous()
    block_m = _block_m(tokens * top_k)
    pairs, block_expert = group_pairs(ids, num_experts, block_m)
    exact = x.dtype == torch.float32 or INTERPRET
    launch = dict(BM=block_m, BN=64, BK=64, EXACT=exact, num_warps=4, **pdl_options(x))
    _expert_product_kernel[(block_expert.numel(), triton.cdiv(inter, 64))](
        x,
        gate_up,
        h,
        pairs,
        block_expert,
        flat_weights,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        h.stride(0),
        inter,
        hidden,
        inter,
        ROWS_PER_PAIR=top_k,
        GATE_UP=True,
        **launch,
    )
    _expert_product_kernel[(block_expert.numel(), triton.cdiv(hidden, 64))](
        h,
        down,
        out,
        pairs,
        block_expert,
        flat_weights,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        out.stride(0),
        hidden,
        inter,
        0,
        ROWS_PER_PAIR=1,
        GATE_UP=False,
        **launch,
    )
    return out.view(tokens, top_k, hidden).sum(1)


def experts_and_shared(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out_dtype: torch.dtype,
    shared_h: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output in `out_dtype` by per-pair GEMVs (a few tokens on the GPU):
    [T, H] = sum_k weights * expert(x), plus sigmoid(shared_gate) * shared_h shared_down^T where
    the shared expert is given (its activation [T, Is], down weight [H, Is], gate logit [T, 1])."""
    check_launchable(x, gate_up, down)
    _check_shapes(x, gate_up, down)
    tokens, hidden = x.shape
    inter, top_k = down.shape[2], ids.shape[1]
    out = torch.empty((tokens, hidden), dtype=out_dtype, device=x.device)
    shared = shared_h is not None
    if shared and (
        shared_down.shape != (hidden, shared_h.shape[1]) or shared_gate.shape != (tokens, 1)
    ):
        raise ValueError(
            f"shared expert: h {tuple(shared_h.shape)}, down {tuple(shared_down.shape)} and gate "
            f"{tuple(shared_gate.shape)} do not fit [T, Is], [H, Is], [T, 1]"
        )
    if tokens == 0:
        return out
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    flat_ids = ids.reshape(-1).contiguous()
    bn, bk = gemv_rows(tokens * top_k * inter, sm_count(x)), GEMV_COLUMNS
    _gate_up_gemv_kernel[(tokens * top_k, triton.cdiv(inter, bn))](
        x,
        gate_up,
        h,
        flat_ids,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        h.stride(0),
        inter,
        hidden,
        TOP_K=top_k,
        BN=bn,
        BK=bk,
        num_warps=4,
        **pdl_options(x),
    )
    bn = gemv_rows(tokens * hidden, sm_count(x))
    # unread without SHARED
    sh, sw, sg = (shared_h, shared_down, shared_gate) if shared else (h, down[0], weights)
    _down_sum_kernel[(tokens, triton.cdiv(hidden, bn))](
        h,
        down,
        flat_ids,
        weights.reshape(-1).contiguous(),
        sh,
        sw,
        sg,
        out,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        sh.stride(0),
        sw.stride(0),
        sg.stride(0),
        out.stride(0),
        hidden,
        inter,
        sh.shape[1],
        TOP_K=top_k,
        BN=bn,
        BK=bk,
        SHARED=shared,
        num_warps=4,
        **pdl_options(x),
    )
    return out


def gemv_path(x: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether a step's experts run as per-pair GEMVs (`experts_and_shared`)."""
    return gpu_path(x) and HAS_TRITON and ids.numel() <= GEMV_PAIRS


def experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' output [T, H] in fp32 (see `experts_reference`)."""
    if gpu_path(x) and HAS_TRITON:
        return experts_triton(x, gate_up, down, weights, ids)
    return experts_reference(x, gate_up, down, weights, ids)
