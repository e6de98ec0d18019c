"""Per-head zero-centred RMSNorm then RoPE (rotate-half, on the leading `rotary_dim` dims) of
the full-attention layer's queries and keys: the plain torch reference and one Triton kernel
for both q and k, which also writes k and v into the paged cache (`KVStore`).

The reference is what the layer does on the CPU (`RMSNorm` then `Rope` of
engine/rank/attention.py), roundings included: the norm's output is cast to the model dtype,
cos and sin are computed in fp32 and cast, and each product and the sum round to the model
dtype. In torch that is ~13 small kernels per tensor; a decode step at batch 1 is bound by
such launches, so the GPU path does it in one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.kernels.kv_quant import FP8, FP8_MAX, e4m3_values
from deltaserve.kernels.rmsnorm import rms_norm_reference
from deltaserve.kernels.triton_compat import (
    check_index,
    check_launchable,
    check_vector,
    pdl_options,
    read_ahead,
    rows_per_program,
    tl,
    triton,
    wait_for_previous_grid,
)


def norm_rope_reference(
    x: torch.Tensor,  # [T, heads, hd]
    weight: torch.Tensor,  # [hd] zero-centred norm weight
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [rotary_dim / 2] fp32
    eps: float,
) -> torch.Tensor:  # [T, heads, hd]
    x = rms_norm_reference(x, weight, eps)
    rotary_dim = 2 * inv_freq.shape[0]
    freqs = positions[:, None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rot.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


@dataclass(frozen=True, slots=True)
class KVStore:
    """The paged cache rows that `norm_rope` also writes the step's keys and values to (the
    idea of nano-vllm's `store_kvcache`, here in the same launch): k normed and rotated, v as
    it is. Caches [rows, nkv, hd] with contiguous rows; index [T], < 0 (padding) skipped. An
    FP8 cache (kernels/kv_quant.py) takes each head's k and v divided by its scale, saturated:
    `kv_scale` fp32 [2, nkv]."""

    v: torch.Tensor  # [T, nkv, hd], rows may be strided
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    index: torch.Tensor
    kv_scale: torch.Tensor | None = None


_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit(do_not_specialize=["tokens"])  # one kernel for every token count (a prompt's are any)
def _norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    inv_freq_ptr,
    index_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scale_ptr,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_kc,
    stride_vc,
    eps,
    tokens,
    QH: tl.constexpr,
    KH: tl.constexpr,
    HD: tl.constexpr,
    BD: tl.constexpr,
    HALF: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr = False,
    ROWS: tl.constexpr = 1,
    GDC: tl.constexpr = False,
    GDC_LATE: tl.constexpr = False,
):
    # program: (ROWS tokens t, head h of q, then of k, then (STORE) of v); one head of HD
    # features a token. The weights, the positions and their cos and sin (and the cache
    # rows) are had before the wait (`read_ahead`), q, k and v after it.
    wait_for_previous_grid(GDC)
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
    live = t < tokens
    h = tl.program_id(1)
    is_q = h < QH
    is_v = h >= QH + KH
    hq = tl.minimum(h, QH - 1)
    hk = tl.minimum(tl.maximum(h - QH, 0), KH - 1)
    hv = tl.maximum(h - QH - KH, 0)
    k_src = k_ptr + t * stride_k_row + hk * stride_k_head
    src = tl.where(
        is_q,
        q_ptr + t * stride_q_row + hq * stride_q_head,
        tl.where(is_v, v_ptr + t * stride_v_row + hv * stride_v_head, k_src),
    )
    w_ptr = tl.where(is_q, qw_ptr, kw_ptr)
    dtype = q_out_ptr.dtype.element_ty
    offs = tl.arange(0, BD)[None, :]
    m = offs < HD
    # the partner of dim d < 2 HALF is d + HALF (first half, sign -) or d - HALF (second half)
    in_rot = offs < 2 * HALF
    first = offs < HALF
    partner = tl.where(first, offs + HALF, offs - HALF)
    w = read_ahead(w_ptr + offs, m, 0.0).to(tl.float32)
    wp = read_ahead(w_ptr + partner, in_rot, 0.0).to(tl.float32)
    pos = read_ahead(pos_ptr + t, live, 0).to(tl.float32)
    freq = read_ahead(inv_freq_ptr + tl.where(first, offs, offs - HALF), in_rot, 0.0)
    angle = pos * freq
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)
    if STORE:
        dest = read_ahead(index_ptr + t, live, -1).to(tl.int64)
        if FP8:  # this head's scale: k's at [0, hk], v's at [1, hv]
            kv_scale = read_ahead(kv_scale_ptr + tl.where(is_v, KH + hv, hk))
    wait_for_previous_grid(GDC_LATE)
    x = tl.load(src + offs, mask=m & live, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 1) / HD + eps)[:, None]
    y = (xf * inv * (1.0 + w)).to(x.dtype)  # the norm's output, in the model dtype
    xp = tl.load(src + partner, mask=in_rot & live, other=0.0).to(tl.float32)
    yp = (xp * inv * (1.0 + wp)).to(x.dtype)
    rotated = tl.where(first, -yp.to(tl.float32), yp.to(tl.float32))
    a = (y.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    b = (rotated * sin).to(x.dtype).to(tl.float32)
    out = tl.where(in_rot, (a + b).to(x.dtype), y)
    dst = tl.where(is_q, q_out_ptr + (t * QH + hq) * HD, k_out_ptr + (t * KH + hk) * HD)
    tl.store(dst + offs, out, mask=(offs < tl.where(is_v, 0, HD)) & live)
    if STORE:  # k's and v's programs: the cache row (a negative one is CUDA-graph padding)
        out = tl.where(is_v, x, out)
        row = tl.maximum(dest, 0)
        cache = tl.where(
            is_v, v_cache_ptr + row * stride_vc + hv * HD, k_cache_ptr + row * stride_kc + hk * HD
        )
        if FP8:
            scaled = tl.clamp(out.to(tl.float32) / kv_scale, -_FP8_MAX, _FP8_MAX)
            out = e4m3_values(scaled).to(k_cache_ptr.dtype.element_ty)
        tl.store(cache + offs, out, mask=offs < tl.where(is_q | (dest < 0), 0, HD))


def norm_rope(
    q: torch.Tensor,  # [T, nh, hd], head dim contiguous (rows may be strided: q of [q | gate])
    k: torch.Tensor,  # [T, nkv, hd]
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [rotary_dim / 2] fp32
    eps: float,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_rope_reference` of q and of k in one launch; new contiguous outputs. With `store`,
    the same launch writes k (as returned) and v into the cache rows it names."""
    check_launchable(q, k)
    tokens, num_q, hd = q.shape
    num_k = k.shape[1]
    if k.shape[0] != tokens or k.shape[2] != hd or k.dtype != q.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not fit q {tuple(q.shape)} {q.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"head dims must be contiguous, got strides {q.stride()}, {k.stride()}")
    check_vector("q_weight", q_weight, hd)
    check_vector("k_weight", k_weight, hd)
    half = inv_freq.shape[0]
    check_vector("inv_freq", inv_freq, half, (torch.float32,))
    if 2 * half > hd:
        raise ValueError(f"inv_freq: expected at most {hd // 2} frequencies, got {half}")
    check_index("positions", positions, tokens)
    if store is not None:
        check_kv_store(store, k)
    q_out = torch.empty((tokens, num_q, hd), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, num_k, hd), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    v, k_cache, v_cache, index = (
        (store.v, store.k_cache, store.v_cache, store.index) if store else (k, k, k, positions)
    )
    fp8 = store is not None and store.k_cache.dtype == FP8
    block = triton.next_power_of_2(hd)
    per_program = rows_per_program()
    _norm_rope_kernel[(triton.cdiv(tokens, per_program), num_q + num_k * (2 if store else 1))](
        q,
        k,
        v,
        q_weight,
        k_weight,
        positions,
        inv_freq,
        index,
        q_out,
        k_out,
        k_cache,
        v_cache,
        store.kv_scale if fp8 else q,  # (unread without FP8)
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        v_cache.stride(0),
        eps,
        tokens,
        QH=num_q,
        KH=num_k,
        HD=hd,
        BD=block,
        HALF=half,
        STORE=store is not None,
        FP8=fp8,
        ROWS=per_program,
        num_warps=1 if block <= 256 else 2,
        **pdl_options(q, reads_ahead="attention"),
    )
    return q_out, k_out


def check_kv_store(store: KVStore, k: torch.Tensor) -> None:
    tokens, num_k, hd = k.shape
    cache_dtype = store.k_cache.dtype if store.k_cache.dtype == FP8 else k.dtype
    for name, t, dtype in (
        ("v", store.v, k.dtype),
        ("k_cache", store.k_cache, cache_dtype),
        ("v_cache", store.v_cache, cache_dtype),
    ):
        if (
            t.dim() != 3
            or t.shape[1:] != (num_k, hd)
            or t.stride(2) != 1
            or t.stride(1) != hd
            or t.dtype != dtype
        ):
            raise ValueError(
                f"{name}: expected [*, {num_k}, {hd}] {dtype} with contiguous rows, got "
                f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    scale = store.kv_scale
    if cache_dtype == FP8 and (
        scale is None
        or scale.shape != (2, num_k)
        or scale.dtype != torch.float32
        or not scale.is_contiguous()
    ):
        raise ValueError(f"an FP8 cache needs kv_scale: fp32 [2, {num_k}] contiguous")
    if store.v.shape[0] != tokens:
        raise ValueError(f"k has {tokens} rows, v {store.v.shape[0]}")
    check_index("kv index", store.index, tokens)
