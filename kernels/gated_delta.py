"""Gated delta rule: the DeltaNet recurrence, in a chunked form for prefill and a per-token
form for decode. Plain torch references; the GPU kernels are checked against these.

Per value head, with state S [dk, dv] (kept fp32 or bf16; every update computed in fp32 and
rounded to the state's dtype where it is stored), for each token t:

    S <- exp(g_t) S
    u_t = beta_t (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t

q and k arrive L2-normalised, q already scaled by dk^-0.5. Key head h serves value heads
h * r ... h * r + r - 1 (r = value heads / key heads), i.e. value head j reads key head j // r.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.machinery import ModuleSpec

import torch

from deltaserve.kernels.triton_compat import (
    check_index,
    check_launchable,
    check_rows,
    check_vector,
    pdl_options,
    tl,
    triton,
    wait_for_previous_grid,
)

CHUNK_SIZE = 64
STATE_DTYPES = (torch.float32, torch.bfloat16)  # what the recurrent state may be kept in
# (block_v, warps) of every decode launch instead of
# the tuned rule (tools/bench_step_ab.py's dv modes)
DECODE_TILE: tuple[int, int] | None = None


def _expand_key_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[..., nk, d] -> [..., nv, d]: value head j reads key head j // (nv / nk)."""
    ratio = num_v_heads // x.shape[-2]
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=-2)


def recurrent_gated_delta(
    q: torch.Tensor,  # [B, nk, dk] fp32
    k: torch.Tensor,  # [B, nk, dk]
    v: torch.Tensor,  # [B, nv, dv]
    g: torch.Tensor,  # [B, nv] log decay (<= 0)
    beta: torch.Tensor,  # [B, nv]
    state: torch.Tensor,  # [B, nv, dk, dv] fp32 or bf16, updated in place
) -> torch.Tensor:  # [B, nv, dv] fp32
    """One token for each of B sequences (the decode step)."""
    nv = v.shape[1]
    q = _expand_key_heads(q, nv).float()
    k = _expand_key_heads(k, nv).float()
    s = state.float() * g.float().exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    u = beta.float()[..., None] * (v.float() - predicted)
    s = s + k[..., :, None] * u[..., None, :]
    state.copy_(s)
    return torch.einsum("bhkv,bhk->bhv", s, q)


def chunk_gated_delta(
    q: torch.Tensor,  # [L, nk, dk]
    k: torch.Tensor,  # [L, nk, dk]
    v: torch.Tensor,  # [L, nv, dv]
    g: torch.Tensor,  # [L, nv]
    beta: torch.Tensor,  # [L, nv]
    state: torch.Tensor,  # [nv, dk, dv] fp32 or bf16, the state before token 0; updated in place
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:  # [L, nv, dv] fp32
    """L tokens of one sequence, `chunk_size` at a time.

    Within a chunk with cumulative log decay c_t = g_1 + ... + g_t and start state S0, the
    corrections u solve the unit lower-triangular system

        u_t + beta_t sum_{s<t} exp(c_t - c_s) (k_t . k_s) u_s = beta_t (v_t - exp(c_t) S0^T k_t)

    and then o_t = exp(c_t) S0^T q_t + sum_{s<=t} exp(c_t - c_s) (q_t . k_s) u_s,
    S_end = exp(c_C) S0 + sum_s exp(c_C - c_s) k_s u_s^T. (The WY/UT idea of the DeltaNet and
    Gated DeltaNet papers, as flash-linear-attention computes it.)
    """
    nv = v.shape[1]
    q = _expand_key_heads(q, nv).float().transpose(0, 1)  # [nv, L, dk]
    k = _expand_key_heads(k, nv).float().transpose(0, 1)
    v = v.float().transpose(0, 1)  # [nv, L, dv]
    g = g.float().transpose(0, 1)  # [nv, L]
    beta = beta.float().transpose(0, 1)
    s = state.float()
    out = torch.empty_like(v)
    length = v.shape[1]
    for begin in range(0, length, chunk_size):
        end = min(begin + chunk_size, length)
        qc, kc, vc = q[:, begin:end], k[:, begin:end], v[:, begin:end]
        bc = beta[:, begin:end, None]
        c = g[:, begin:end].cumsum(dim=1)  # [nv, C]
        n = end - begin
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        # decay[t, s] = exp(c_t - c_s) for s <= t, else 0
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=v.device), 0.0)
        system = bc * (kc @ kc.transpose(1, 2)) * strict
        system = system + torch.eye(n, dtype=system.dtype, device=v.device)
        rhs = bc * (vc - c.exp()[..., None] * (kc @ s))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, begin:end] = c.exp()[..., None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u
        tail = (c[:, -1:] - c).exp()[..., None]  # [nv, C, 1]
        s = c[:, -1].exp()[:, None, None] * s + (kc * tail).transpose(1, 2) @ u
    state.copy_(s)
    return out.transpose(0, 1)


def delta_rule_inputs(
    mixed: torch.Tensor,  # [T, 2 * nk * dk + nv * dv] post-conv [q | k | v] of each token
    a: torch.Tensor,  # [T, nv] in_proj_a output (raw)
    b: torch.Tensor,  # [T, nv] in_proj_b output (raw)
    a_log: torch.Tensor,  # [nv]
    dt_bias: torch.Tensor,  # [nv]
    num_k_heads: int,
    dv: int,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule's per-token inputs (q, k, v, g, beta) from the conv output and
    in_proj's raw a, b, as HF and flash-linear-attention make them: L2-normalised q (times
    dk^-0.5) and k in fp32, g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b)
    in the model dtype. The one definition behind the CPU layer and both GPU references."""
    nk = num_k_heads
    dk = (mixed.shape[1] - a.shape[1] * dv) // (2 * nk)
    q, k, v = mixed.split((nk * dk, nk * dk, a.shape[1] * dv), dim=-1)
    q, k = q.reshape(-1, nk, dk).float(), k.reshape(-1, nk, dk).float()
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + eps) * dk**-0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps)
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return q, k, v.reshape(-1, a.shape[1], dv), g, b.sigmoid()


# ---- decode step on the GPU: one fused kernel per layer for every decode request ----------


def gated_delta_decode_reference(
    mixed: torch.Tensor,  # [T, 2 * nk * dk + nv * dv] post-conv [q | k | v] of each token
    a: torch.Tensor,  # [T, nv] in_proj_a output (raw)
    b: torch.Tensor,  # [T, nv] in_proj_b output (raw)
    a_log: torch.Tensor,  # [nv]
    dt_bias: torch.Tensor,  # [nv]
    state: torch.Tensor,  # [slots, nv, dk, dv] fp32 or bf16, updated in place at `slots`
    rows: torch.Tensor,  # [D] token of each decode request
    slots: torch.Tensor,  # [D] its state slot
    out: torch.Tensor,  # [T, nv, dv]; rows `rows` are written
    num_k_heads: int,
    eps: float = 1e-6,
) -> None:
    """What the kernel computes, as the DeltaNet layer does it in plain torch: L2-normalised
    q (times dk^-0.5) and k, beta = sigmoid(b) in the model dtype, g = -exp(A_log) *
    softplus(a + dt_bias) in fp32, then one `recurrent_gated_delta` step."""
    rows, slots = rows.long(), slots.long()
    q, k, v, g, beta = delta_rule_inputs(
        mixed[rows], a[rows], b[rows], a_log, dt_bias, num_k_heads, state.shape[-1], eps
    )
    s = state[slots]
    o = recurrent_gated_delta(q, k, v, g, beta, s)
    state[slots] = s
    out[rows] = o.to(out.dtype)


@triton.jit
def _gated_delta_decode_kernel(
    mixed_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    rows_ptr,
    slots_ptr,
    out_ptr,
    stride_mixed,
    stride_a,
    stride_b,
    stride_slot,
    stride_out,
    q_scale,
    eps,
    NK: tl.constexpr,
    NV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    EVICT: tl.constexpr,
    GDC: tl.constexpr = False,
):
    # program: (decode request i, value head h, block of BV value columns)
    wait_for_previous_grid(GDC)
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    # a negative slot is a padding row of a CUDA graph: every mask is empty, nothing is touched
    num_k = tl.where(slot >= 0, DK, 0)
    num_v = tl.where(slot >= 0, DV, 0)
    slot = tl.maximum(slot, 0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < num_k
    mv = offs_v < num_v
    smask = mk[:, None] & mv[None, :]
    # state first: the one big read, in flight while the small vectors arrive
    s_ptrs = state_ptr + slot * stride_slot + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    kh = h // (NV // NK)
    base = mixed_ptr + row * stride_mixed
    q = tl.load(base + kh * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(base + (NK + kh) * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * NK * DK + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * stride_a + h).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + h)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)  # rounded as torch does
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    decay = tl.exp(-tl.exp(a_log) * softplus)

    s = s * decay
    u = beta * (v - tl.sum(s * k[:, None], 0))  # [BV]
    s = s + k[:, None] * u[None, :]
    o = tl.sum(s * q[:, None], 0)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=smask, eviction_policy=EVICT)
    tl.store(out_ptr + row * stride_out + h * DV + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)


def gated_delta_decode(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    num_k_heads: int,
    eps: float = 1e-6,
    block_v: int | None = None,
    num_warps: int | None = None,
    evict_first: bool = False,
) -> None:
    """Triton launch of `gated_delta_decode_reference` (same arguments): each request's state
    (fp32 or bf16, computed in fp32) is read and written once, in place in its slot. Rows with
    slot < 0 are skipped.
    `block_v`, `num_warps`, `evict_first` override the tuned launch (tools/bench_decode.py)."""
    check_launchable(mixed, state)
    num_slots, nv, dk, dv = state.shape
    nk = num_k_heads
    if nk < 1 or nv % nk:
        raise ValueError(f"value heads {nv} are not a multiple of key heads {nk}")
    if state.dtype not in STATE_DTYPES or state.stride()[1:] != (dk * dv, dv, 1):
        raise ValueError(
            f"state: expected fp32 or bf16 [slots, nv, dk, dv] with contiguous heads, got "
            f"{state.dtype} strides {state.stride()}"
        )
    tokens = mixed.shape[0]
    check_rows("mixed", mixed, 2 * nk * dk + nv * dv)
    check_rows("a", a, nv)
    check_rows("b", b, nv)
    if a.shape[0] != tokens or b.shape[0] != tokens or out.shape[0] != tokens:
        raise ValueError(
            f"a, b, out need {tokens} rows, got {a.shape[0]}, {b.shape[0]}, {out.shape[0]}"
        )
    check_vector("A_log", a_log, nv)
    check_vector("dt_bias", dt_bias, nv)
    if out.dim() != 3 or out.shape[1:] != (nv, dv) or out.stride()[1:] != (dv, 1):
        raise ValueError(
            f"out: expected [T, {nv}, {dv}] with contiguous heads, "
            f"got {tuple(out.shape)} {out.stride()}"
        )
    num = rows.shape[0]
    check_index("rows", rows, num)
    check_index("slots", slots, num)
    if num == 0:
        return
    bk = triton.next_power_of_2(dk)
    # tuned on the H200 at 4B shapes (bench/results): small tiles while the grid is small
    programs = num * nv
    if DECODE_TILE is not None:
        block_v, num_warps = block_v or DECODE_TILE[0], num_warps or DECODE_TILE[1]
    bv = block_v or min(
        triton.next_power_of_2(dv), 16 if programs <= 64 else 32 if programs <= 256 else 64
    )
    warps = num_warps or (2 if bv <= 32 else 4)
    grid = (num, nv, triton.cdiv(dv, bv))
    _gated_delta_decode_kernel[grid](
        mixed,
        a,
        b,
        a_log,
        dt_bias,
        state,
        rows,
        slots,
        out,
        mixed.stride(0),
        a.stride(0),
        b.stride(0),
        state.stride(0),
        out.stride(0),
        dk**-0.5,
        eps,
        NK=nk,
        NV=nv,
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        EVICT="evict_first" if evict_first else "",
        num_warps=warps,
        **pdl_options(mixed),
    )


# ---- prefill on the GPU: flash-linear-attention's chunked kernel when it is installed -------


@dataclass(frozen=True, slots=True)
class FlaPrefill:
    """fla-core's chunked forward and its helpers, called directly: its public entry wraps
    them in an autograd Function and an input guard whose Python cost (~1 ms per layer on
    the H200's host) outweighed the kernels of a 1k-token prefill."""

    forward: Callable  # chunk_gated_delta_rule_fwd


@functools.cache
def fla_chunk_kernel() -> FlaPrefill | None:
    """fla-core's prefill pieces (optional, GPU only), or None when absent."""
    # fla's backend dispatch wraps each op in a per-call backend search; on CUDA its default
    # Triton kernels are the ones we call anyway
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    try:
        import_lazily(["fla.ops", "fla.modules", "fla.modules.norm"])
        with compiler_disable_as_is():
            from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except Exception:  # not installed, or no usable GPU backend
        return None
    return FlaPrefill(chunk_gated_delta_rule_fwd)


def import_lazily(names: list[str]) -> None:
    """Import packages `names` (parents first) without running their __init__, which for
    fla's import every op and module it has: seconds of a rank's start-up for three
    functions. Each runs its real __init__ the first time a name it defines is asked for
    (`from fla.modules import X`: HF's fla path, in the benchmarks)."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not a package")
        package = importlib.util.module_from_spec(spec)  # its __init__ not run

        def run_init(
            attr: str, package: types.ModuleType = package, spec: ModuleSpec = spec
        ) -> object:
            del package.__getattr__  # once: the real __init__ fills the module in
            spec.loader.exec_module(package)
            return getattr(package, attr)

        package.__getattr__ = run_init
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, package)


@contextlib.contextmanager
def compiler_disable_as_is() -> Iterator[None]:
    """Within: `torch.compiler.disable` returns its function unchanged. Decorating with it
    imports torch._dynamo (a second or more); outside torch.compile, which a rank never
    runs, the decorated function and the function are the same."""
    saved = torch.compiler.disable
    torch.compiler.disable = lambda fn=None, recursive=True, reason=None: (
        fn if fn is not None else (lambda f: f)
    )
    try:
        yield
    finally:
        torch.compiler.disable = saved


def gated_delta_prefill_reference(
    # [L, 2 * nk * dk + nv * dv] post-conv [q | k | v], sequences packed end to end
    mixed: torch.Tensor,
    a: torch.Tensor,  # [L, nv] in_proj_a output (raw)
    b: torch.Tensor,  # [L, nv] in_proj_b output (raw)
    a_log: torch.Tensor,  # [nv]
    dt_bias: torch.Tensor,  # [nv]
    state: torch.Tensor,  # [slots, nv, dk, dv] fp32 or bf16; each sequence's slot updated in place
    slots: torch.Tensor,  # [n] each sequence's slot (-1: an empty padding sequence)
    # [n + 1] cumulative lengths over mixed's rows (rows past the last: padding)
    bounds: torch.Tensor,
    num_k_heads: int,
    eps: float = 1e-6,
    store_slots: torch.Tensor | None = None,  # [n] where each final state goes (-1: nowhere)
) -> torch.Tensor:  # [L, nv, dv] in mixed's dtype
    """`chunk_gated_delta` sequence by sequence, on the inputs the decode kernel derives;
    each sequence's final state written to its slot, or to `store_slots` where given."""
    q, k, v, g, beta = delta_rule_inputs(
        mixed, a, b, a_log, dt_bias, num_k_heads, state.shape[-1], eps
    )
    out = torch.zeros(v.shape, dtype=mixed.dtype, device=v.device)
    edges = bounds.tolist()
    stores = slots.tolist() if store_slots is None else store_slots.tolist()
    for slot, store, start, end in zip(slots.tolist(), stores, edges[:-1], edges[1:], strict=True):
        if end > start:
            piece = slice(start, end)
            final = state[slot] if store == slot else state[slot].clone()
            out[piece] = chunk_gated_delta(
                q[piece], k[piece], v[piece], g[piece], beta[piece], final
            )
            if store not in (slot, -1):
                state[store] = final
    return out


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])  # a PackedSpans.index row
def _store_states_kernel(
    src_ptr, dst_ptr, slots_ptr, numel, stride_src, stride_dst, BLOCK: tl.constexpr
):
    # program: (sequence i, block of BLOCK elements of its state); slot < 0: nothing
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    x = tl.load(src_ptr + i.to(tl.int64) * stride_src + offs, mask=m)
    tl.store(dst_ptr + slot * stride_dst + offs, x, mask=m)


def store_states(state: torch.Tensor, slots: torch.Tensor, final: torch.Tensor) -> None:
    """state[slots[i]] = final[i] for every slot >= 0: a padding sequence (slot -1) of a CUDA
    graph writes nowhere, where `state[slots] = final` would write some real slot twice."""
    check_index("slots", slots, final.shape[0])
    if final.shape[1:] != state.shape[1:] or final.dtype != state.dtype:
        raise ValueError(
            f"final {tuple(final.shape)} {final.dtype} "
            f"does not fit state {tuple(state.shape)} {state.dtype}"
        )
    if not (state[0].is_contiguous() and final[0].is_contiguous()):
        raise ValueError("store_states needs each slot's state contiguous")
    numel = state[0].numel()
    if final.shape[0] and numel:
        block = 4096
        grid = (final.shape[0], triton.cdiv(numel, block))
        _store_states_kernel[grid](
            final, state, slots, numel, final.stride(0), state.stride(0), BLOCK=block
        )


@triton.jit
def _fla_inputs_kernel(
    mixed_ptr,
    a_ptr,
    b_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    stride_mixed,
    stride_a,
    stride_b,
    eps,
    NK: tl.constexpr,
    NV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    # program: (token t, key head h): q and k of head h L2-normalised as fla's l2norm does
    # (x / sqrt(sum x^2 + eps) in fp32), then the value heads h * r .. h * r + r - 1 that
    # read it: v copied, g = a copied, beta = sigmoid(b)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = mixed_ptr + t * stride_mixed
    ok = tl.arange(0, BK)
    mk = ok < DK
    for part in tl.static_range(2):  # q, then k
        x = tl.load(row + part * NK * DK + h * DK + ok, mask=mk, other=0.0).to(tl.float32)
        y = x * (1 / tl.sqrt(tl.sum(x * x, 0) + eps))
        dst = q_ptr if part == 0 else k_ptr
        tl.store(dst + (t * NK + h) * DK + ok, y.to(dst.dtype.element_ty), mask=mk)
    ov = tl.arange(0, BV)
    mv = ov < DV
    for j in tl.static_range(NV // NK):
        vh = h * (NV // NK) + j
        v = tl.load(row + 2 * NK * DK + vh * DV + ov, mask=mv, other=0.0)
        tl.store(v_ptr + (t * NV + vh) * DV + ov, v, mask=mv)
        tl.store(g_ptr + t * NV + vh, tl.load(a_ptr + t * stride_a + vh))
        b = tl.load(b_ptr + t * stride_b + vh).to(tl.float32)
        tl.store(beta_ptr + t * NV + vh, tl.sigmoid(b).to(beta_ptr.dtype.element_ty))


def fla_inputs(
    mixed: torch.Tensor,  # [T, 2 * nk * dk + nv * dv] post-conv [q | k | v], rows may be strided
    a: torch.Tensor,  # [T, nv] in_proj_a output (raw), rows may be strided
    b: torch.Tensor,  # [T, nv] in_proj_b output (raw)
    num_k_heads: int,
    dk: int,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What fla's chunked forward takes, contiguous, in one kernel: q, k [T, nk, dk] L2-normalised
    (unscaled: fla scales q), v [T, nv, dv], g = a [T, nv] (fla makes the decay from it), beta =
    sigmoid(b) [T, nv]. It stands for two row copies and two fla l2norm launches for q and k,
    copies of v and a, and the sigmoid: seven launches per layer, which on the H200's host
    cost more time than their kernels."""
    check_launchable(mixed, a, b)
    length, nv = a.shape
    nk = num_k_heads
    dv = (mixed.shape[1] - 2 * nk * dk) // nv
    check_rows("mixed", mixed, 2 * nk * dk + nv * dv)
    check_rows("a", a, nv)
    check_rows("b", b, nv)
    if nv % nk or b.shape[0] != length or mixed.shape[0] != length:
        raise ValueError(
            f"fla_inputs: {nv} value heads over {nk} key heads, rows "
            f"{mixed.shape[0]}/{length}/{b.shape[0]}"
        )
    new = functools.partial(torch.empty, dtype=mixed.dtype, device=mixed.device)
    q, k, v = new((length, nk, dk)), new((length, nk, dk)), new((length, nv, dv))
    g, beta = (
        torch.empty((length, nv), dtype=a.dtype, device=a.device),
        new((length, nv), dtype=b.dtype),
    )
    if length:
        _fla_inputs_kernel[(length, nk)](
            mixed,
            a,
            b,
            q,
            k,
            v,
            g,
            beta,
            mixed.stride(0),
            a.stride(0),
            b.stride(0),
            eps,
            NK=nk,
            NV=nv,
            DK=dk,
            DV=dv,
            BK=triton.next_power_of_2(dk),
            BV=triton.next_power_of_2(dv),
        )
    return q, k, v, g, beta


def gated_delta_prefill(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    bounds: torch.Tensor,  # int32 on CUDA
    # [entries, 2] int32: (sequence, CHUNK_SIZE-token chunk), fla's chunk_indices
    chunks: torch.Tensor,
    num_k_heads: int,
    eps: float = 1e-6,
    store_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gated_delta_prefill_reference` (same arguments, plus the chunk table) in one call of
    fla's varlen chunk kernel on CUDA when fla is installed: q, k, v go in as the model dtype
    (as HF's fla path does; fla takes and gives fp32 states, rounded to a bf16 cache's dtype
    as they are stored), and the L2 norms and the decay are computed
    inside fla's kernels instead of by a dozen elementwise passes here. Every grid is fixed
    by the sizes of `bounds` and `chunks`, so a CUDA graph can hold the call: padding entries
    of `chunks` name an empty sequence, whose programs return at once."""
    fla = fla_chunk_kernel() if mixed.is_cuda else None
    if fla is None:
        return gated_delta_prefill_reference(
            mixed, a, b, a_log, dt_bias, state, slots, bounds, num_k_heads, eps, store_slots
        )
    dk = state.shape[2]
    q, k, v, g, beta = fla_inputs(mixed, a, b, num_k_heads, dk, eps)
    _, out, _, final, _, _ = fla.forward(
        q=q[None],
        k=k[None],
        v=v[None],
        g=g[None],
        beta=beta[None],
        scale=dk**-0.5,
        initial_state=state[slots.clamp(min=0)].float(),
        output_final_state=True,
        cu_seqlens=bounds,
        chunk_indices=chunks,
        use_gate_in_kernel=True,
        A_log=a_log,
        dt_bias=dt_bias,  # made fp32 inside fla's gate kernel
    )
    store_states(state, slots if store_slots is None else store_slots, final.to(state.dtype))
    return out[0].to(mixed.dtype)
