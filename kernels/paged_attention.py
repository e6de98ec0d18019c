"""Causal GQA attention over a paged KV cache, plain torch.

The cache is flat: row `block * block_size + offset` holds one position of one request. A span
of L queries at positions start .. start+L-1 attends to its request's positions 0 .. its own.
An FP8 cache (kernels/kv_quant.py) comes with `kv_scale` [2, nkv] (the layer's key and value
scales): its rows are multiplied back as they are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.kernels.activation import times_sigmoid
from deltaserve.kernels.kv_quant import FP8, dequantize
from deltaserve.kernels.triton_compat import (
    H200_SMS,
    INTERPRET,
    check_index,
    check_launchable,
    pdl_options,
    read_ahead,
    sm_count,
    tl,
    triton,
    wait_for_previous_grid,
)

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what the flash kernel takes


@dataclass(frozen=True, slots=True)
class KeyBlocks:
    """The KV blocks a step's prompt chunks attend to, for `gathered_prefill_attention`: each
    span's blocks from its position 0, span after span; trailing entries name any block and
    belong to no span."""

    blocks: torch.Tensor  # [entries] int64: cache blocks
    bounds: torch.Tensor  # [n + 1] int32: where each span's keys start in the gathered rows
    lengths: torch.Tensor  # [n] int32: the keys each span attends to (its chunk's end position)


def flash_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether such queries go to flash (CUDA, half precision, head dim <= 256 and a multiple
    of 8); the other path is torch's SDPA, span by span."""
    return device.type == "cuda" and dtype in FLASH_DTYPES and head_dim <= 256 and head_dim % 8 == 0


def request_rows(block_table: torch.Tensor, block_size: int, num_positions: int) -> torch.Tensor:
    """Cache rows of positions 0 .. num_positions-1 of a request, in order."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[:, None] * block_size + offsets).flatten()[:num_positions]


def read_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    kv_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of cache `rows`, in `dtype` (an FP8 cache's multiplied back)."""
    k, v = k_cache[rows], v_cache[rows]
    if k_cache.dtype != FP8:
        return k, v
    return dequantize(k, kv_scale[0], dtype), dequantize(v, kv_scale[1], dtype)


def paged_attention(
    q: torch.Tensor,  # [L, nh, hd], one request's queries
    k_cache: torch.Tensor,  # [rows, nkv, hd]
    v_cache: torch.Tensor,  # [rows, nkv, hd]
    block_table: torch.Tensor,  # [blocks] int64
    block_size: int,
    start: int,  # position of q[0]
    scale: float,
    kv_scale: torch.Tensor | None = None,  # [2, nkv] of an FP8 cache
) -> torch.Tensor:  # [L, nh, hd]
    length, num_heads, _ = q.shape
    rows = request_rows(block_table, block_size, start + length)
    k, v = read_rows(k_cache, v_cache, rows, kv_scale, q.dtype)  # [P, nkv, hd]
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,phd->hlp", q, k).float() * scale
    query_pos = torch.arange(start, start + length, device=q.device)[:, None]
    key_pos = torch.arange(start + length, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.einsum("hlp,phd->lhd", probs, v)


def prefill_attention(
    q: torch.Tensor,  # [L, nh, hd], one request's queries at positions start .. start+L-1
    k: torch.Tensor,  # [start + L, nkv, hd], its keys from position 0
    v: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:  # [L, nh, hd]
    """Flash attention on the GPU (FA2, inside torch), torch's SDPA elsewhere: the causal mask
    aligned to the bottom right, since a chunk's queries start at `start`, and GQA without
    repeating K and V. Never materialises the [heads, L, P] scores on the GPU."""
    length = q.shape[0]
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    if flash_takes(q.device, q.dtype, q.shape[-1]):
        # Called directly: SDPA itself picks cuDNN on Hopper, which builds a graph for every new
        # (query, key) length, and a bottom-right mask through torch.nn.attention.bias imports
        # torch._dynamo (seconds of start-up). Flash's causal mask is bottom-right aligned.
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q4, k4, v4, 0.0, True, False, scale=scale
        )[0]
        return out[0].transpose(0, 1)
    mask = None
    if start:  # query i (position start + i) sees keys 0 .. start + i
        mask = torch.ones(length, start + length, dtype=torch.bool, device=q.device).tril(start)
    out = F.scaled_dot_product_attention(
        q4, k4, v4, attn_mask=mask, is_causal=not start, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def varlen_prefill_attention(
    # [T, nh, hd]: the first chunks of prompts, packed end to end (rows past bounds[-1]: padding)
    q: torch.Tensor,
    k: torch.Tensor,  # [T, nkv, hd]
    v: torch.Tensor,
    bounds: torch.Tensor,  # [n + 1] int32: cumulative lengths (cu_seqlens); empty spans allowed
    max_len: int,  # host bound on the lengths: sizes flash's grid
    scale: float,
) -> torch.Tensor:  # [T, nh, hd]; padding rows unwritten
    """Causal attention of every span over its own keys in one launch: flash's varlen kernel
    on the GPU, whose grid is fixed by `max_len` and the number of spans, so a CUDA graph can
    hold it; `prefill_attention` span by span elsewhere."""
    out = torch.empty_like(q)
    if flash_takes(q.device, q.dtype, q.shape[-1]):
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, bounds, bounds, max_len, max_len, 0.0, True, False, scale=scale
        )[0]
        return out
    edges = bounds.tolist()
    for start, end in zip(edges[:-1], edges[1:], strict=True):
        if end > start:
            out[start:end] = prefill_attention(q[start:end], k[start:end], v[start:end], 0, scale)
    return out


def gathered_prefill_attention(
    q: torch.Tensor,  # [T, nh, hd]: prompt chunks packed end to end (rows past bounds[-1]: padding)
    k_cache: torch.Tensor,  # [rows, nkv, hd], the chunks' own keys already stored
    v_cache: torch.Tensor,
    bounds: torch.Tensor,  # [n + 1] int32: cumulative chunk lengths (cu_seqlens of the queries)
    keys: KeyBlocks,
    max_len: int,  # host bound on the chunk lengths
    block_size: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,  # [2, nkv] of an FP8 cache
) -> torch.Tensor:  # [T, nh, hd]; padding rows unwritten
    """Causal attention of chunks that may follow cached positions (prefix caching), every
    span in one launch and by sizes fixed on the host, so a prompt CUDA graph can hold it:
    the spans' KV blocks gathered whole, in order (`keys.blocks`), then flash's varlen kernel
    over them, each span using only its first `keys.lengths` keys (`seqused_k`; its causal
    mask is aligned to the last of them). `prefill_attention` span by span off flash."""
    rows = (keys.blocks[:, None] * block_size + torch.arange(block_size, device=q.device)).flatten()
    k, v = read_rows(k_cache, v_cache, rows, kv_scale, q.dtype)
    if flash_takes(q.device, q.dtype, q.shape[-1]):
        return torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            bounds,
            keys.bounds,
            max_len,
            int(rows.shape[0]),
            0.0,
            True,
            False,
            scale=scale,
            seqused_k=keys.lengths,
        )[0]
    out = torch.empty_like(q)
    spans = zip(
        bounds[:-1].tolist(),
        bounds[1:].tolist(),
        keys.bounds[:-1].tolist(),
        keys.lengths.tolist(),
        strict=True,
    )
    for start, end, first_key, used in spans:
        if end > start:
            piece = slice(first_key, first_key + used)
            out[start:end] = prefill_attention(
                q[start:end], k[piece], v[piece], used - (end - start), scale
            )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [L, nh, hd], one request's queries
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    start: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,  # [2, nkv] of an FP8 cache
) -> torch.Tensor:  # [L, nh, hd]
    """`paged_attention` by `prefill_attention` over the request's keys gathered from the
    cache (a later chunk of a prompt: the earlier chunks' keys are only there)."""
    rows = request_rows(block_table, block_size, start + q.shape[0])
    return prefill_attention(q, *read_rows(k_cache, v_cache, rows, kv_scale, q.dtype), start, scale)


# ---- decode step on the GPU: one query token per request, all requests in one launch ------
# Split-K over the context ("flash-decoding"): each program reads one KV head of one request
# over one partition of its positions, for all the query heads of that KV head at once (so K
# and V are read once); a second kernel merges the partitions by their log-sum-exp.


def paged_decode_attention_reference(
    q: torch.Tensor,  # [T, nh, hd] queries of the step
    k_cache: torch.Tensor,  # [rows, nkv, hd]
    v_cache: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [D, max_blocks] KV blocks of each decode request
    seq_lens: torch.Tensor,  # [D] positions each attends to (its own included)
    rows: torch.Tensor,  # [D] token of each decode request in q / out
    block_size: int,
    scale: float,
    out: torch.Tensor,  # [T, nh, hd]; rows `rows` are written
    kv_scale: torch.Tensor | None = None,  # [2, nkv] of an FP8 cache
) -> None:
    """`paged_attention` on one query per request, request by request."""
    for i, (row, length) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        table = block_tables[i, : -(-length // block_size)].long()
        out[row : row + 1] = paged_attention(
            q[row : row + 1], k_cache, v_cache, table, block_size, length - 1, scale, kv_scale
        )


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    rows_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    gate_ptr,
    kv_scale_ptr,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_table,
    stride_out_row,
    stride_out_head,
    stride_gate_row,
    stride_gate_head,
    scale,
    block_size,
    num_heads,
    GROUP: tl.constexpr,
    BG: tl.constexpr,
    HD: tl.constexpr,
    BD: tl.constexpr,
    BN: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    EXACT: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr = False,
    GDC: tl.constexpr = False,
    GDC_LATE: tl.constexpr = False,
):
    # program: (decode request i, KV head kvh, partition p of the context). FP8: the cache's
    # keys and values are taken as q's dtype (e4m3 holds no value bf16 cannot), the head's key
    # scale joins the softmax scale and its value scale multiplies the result
    wait_for_previous_grid(GDC)
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = read_ahead(seq_lens_ptr + i)
    row = read_ahead(rows_ptr + i).to(tl.int64)
    v_scale = 1.0
    if FP8:
        scale = scale * read_ahead(kv_scale_ptr + kvh)
        v_scale = read_ahead(kv_scale_ptr + tl.num_programs(1) + kvh)
    wait_for_previous_grid(GDC_LATE)  # the keys and values: norm_rope has just written the last
    offs_g = tl.arange(0, BG)
    offs_d = tl.arange(0, BD)
    heads = kvh * GROUP + offs_g
    mq = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HD)
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mq,
        other=0.0,
    )
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    part_len = tl.cdiv(tl.cdiv(seq_len, NUM_PARTS), BN) * BN
    begin = p * part_len
    end = tl.minimum(begin + part_len, seq_len)
    for n0 in range(begin, end, BN):
        pos = n0 + tl.arange(0, BN)
        mn = pos < end
        block = tl.load(tables_ptr + i * stride_table + pos // block_size, mask=mn, other=0).to(
            tl.int64
        )
        cache_row = block * block_size + pos % block_size
        mkv = mn[:, None] & (offs_d[None, :] < HD)
        k = tl.load(
            k_ptr + cache_row[:, None] * stride_k_row + kvh * stride_k_head + offs_d[None, :],
            mask=mkv,
            other=0.0,
        )
        v = tl.load(
            v_ptr + cache_row[:, None] * stride_v_row + kvh * stride_v_head + offs_d[None, :],
            mask=mkv,
            other=0.0,
        )
        if FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if EXACT:  # fp32 model (or the interpreter, whose bf16 dot is wrong): fp32 products
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale  # [BG, BN]
        scores = tl.where(mn[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        probs = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(probs, 1)
        if EXACT:
            pv = tl.dot(probs.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(probs.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None] * v_scale  # an empty partition (or a padding row): zeros
    if NUM_PARTS == 1:
        o_ptrs = out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + offs_d[None, :]
        g_ptrs = (
            gate_ptr + row * stride_gate_row + heads[:, None] * stride_gate_head + offs_d[None, :]
        )
        tl.store(o_ptrs, _output(result, g_ptrs, mq, out_ptr.dtype.element_ty, GATED), mask=mq)
    else:
        # partials: part [D, nh, NUM_PARTS, HD] fp32, lse [D, nh, NUM_PARTS]
        slot = (i * num_heads + heads) * NUM_PARTS + p
        tl.store(part_ptr + slot[:, None] * HD + offs_d[None, :], result, mask=mq)
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        tl.store(lse_ptr + slot, lse, mask=offs_g < GROUP)


@triton.jit
def _output(result, gate_ptrs, mask, dtype: tl.constexpr, GATED: tl.constexpr):
    """The attention output in the model dtype; GATED: times sigmoid(gate), as the layer's
    `sigmoid_gate` after it would make it (rounded alike)."""
    if GATED:
        return times_sigmoid(result.to(dtype), tl.load(gate_ptrs, mask=mask, other=0.0)).to(dtype)
    return result.to(dtype)


@triton.jit
def _merge_parts_kernel(
    part_ptr,
    lse_ptr,
    rows_ptr,
    out_ptr,
    gate_ptr,
    stride_out_row,
    stride_out_head,
    stride_gate_row,
    stride_gate_head,
    num_heads,
    HD: tl.constexpr,
    BD: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BP: tl.constexpr,
    GATED: tl.constexpr,
    GDC: tl.constexpr = False,
    GDC_LATE: tl.constexpr = False,
):
    wait_for_previous_grid(GDC)
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = read_ahead(rows_ptr + i).to(tl.int64)
    wait_for_previous_grid(GDC_LATE)
    offs_p = tl.arange(0, BP)
    offs_d = tl.arange(0, BD)
    base = (i * num_heads + h) * NUM_PARTS
    lse = tl.load(lse_ptr + base + offs_p, mask=offs_p < NUM_PARTS, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    total = tl.sum(weight, 0)
    mask = (offs_p[:, None] < NUM_PARTS) & (offs_d[None, :] < HD)
    parts = tl.load(
        part_ptr + (base + offs_p[:, None]) * HD + offs_d[None, :], mask=mask, other=0.0
    )
    result = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    g_ptrs = gate_ptr + row * stride_gate_row + h * stride_gate_head + offs_d
    tl.store(
        out_ptr + row * stride_out_row + h * stride_out_head + offs_d,
        _output(result, g_ptrs, offs_d < HD, out_ptr.dtype.element_ty, GATED),
        mask=offs_d < HD,
    )


# Programs per SM the decode split aims at (`decode_partitions`; tools/bench_step_ab.py's
# parts modes try others).
PARTS_PER_SM = 2
# (block_n, warps, stages) of the decode kernel in place of its rule; set only by
# tools/bench_step_ab.py's att modes.
DECODE_LAUNCH: tuple[int, int, int] | None = None


def decode_partitions(
    num_requests: int,
    num_kv_heads: int,
    max_seq_len: int,
    tile: int,
    per_sm: int | None = None,
    sms: int = H200_SMS,
) -> int:
    """How many partitions split each request's context: enough programs to fill the GPU's
    `sms` SMs `per_sm` times over, never more than `max_seq_len` has tiles. Each request divides
    its own context evenly among them (in the kernel), so a CUDA graph can fix this number
    while the lengths change."""
    tiles = max(1, -(-max_seq_len // tile))
    per_sm = PARTS_PER_SM if per_sm is None else per_sm
    return max(1, min(tiles, -(-sms * per_sm // max(1, num_requests * num_kv_heads))))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    max_seq_len: int,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    parts_per_sm: int | None = None,
    gate: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Triton launch of `paged_decode_attention_reference` (same arguments) plus
    `max_seq_len`, a host-side bound on `seq_lens` that sizes the grid (a CUDA graph keeps
    it fixed). A request with seq_len 0 (a padding row) gets zeros. With `gate` (like q, rows
    may be strided) the rows written are `sigmoid_gate(attention, gate)`'s. An FP8 cache
    needs `kv_scale` (fp32 [2, nkv], contiguous). The other keyword arguments override the
    tuned launch (tools/bench_decode.py)."""
    check_launchable(q, k_cache)
    tokens, num_heads, hd = q.shape
    _, num_kv, _ = k_cache.shape
    if num_kv < 1 or num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv}")
    fp8 = k_cache.dtype == FP8
    if (
        k_cache.shape != v_cache.shape
        or k_cache.shape[2] != hd
        or k_cache.dtype != v_cache.dtype
        or k_cache.dtype not in (q.dtype, FP8)
    ):
        raise ValueError(
            f"k/v cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)} {k_cache.dtype} "
            f"do not fit queries {tuple(q.shape)} {q.dtype}"
        )
    if fp8 and (
        kv_scale is None
        or kv_scale.shape != (2, num_kv)
        or kv_scale.dtype != torch.float32
        or not kv_scale.is_contiguous()
    ):
        raise ValueError(f"an FP8 cache needs kv_scale: fp32 [2, {num_kv}] contiguous")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}: head_dim must be contiguous, got strides {t.stride()}")
    if out.shape != q.shape or (
        gate is not None and (gate.shape != q.shape or gate.stride(2) != 1)
    ):
        raise ValueError(
            f"out {tuple(out.shape)} and gate must match q {tuple(q.shape)}, head_dim contiguous"
        )
    num = rows.shape[0]
    check_index("rows", rows, num)
    check_index("seq_lens", seq_lens, num)
    if block_tables.dim() != 2 or block_tables.shape[0] != num or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables: expected [{num}, max_blocks] contiguous rows, got "
            f"{tuple(block_tables.shape)} strides {block_tables.stride()}"
        )
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the block tables' "
            f"{block_tables.shape[1]} blocks of {block_size}"
        )
    if num == 0:
        return
    group = num_heads // num_kv
    if DECODE_LAUNCH is not None:
        block_n, num_warps, num_stages = (
            block_n or DECODE_LAUNCH[0],
            num_warps or DECODE_LAUNCH[1],
            num_stages or DECODE_LAUNCH[2],
        )
    tile = block_n or (64 if hd <= 128 else 32)
    num_parts = decode_partitions(num, num_kv, max_seq_len, tile, parts_per_sm, sm_count(q))
    bd = triton.next_power_of_2(hd)
    part = lse = out  # unused when there is one partition
    if num_parts > 1:
        part = torch.empty((num, num_heads, num_parts, hd), dtype=torch.float32, device=q.device)
        lse = torch.empty((num, num_heads, num_parts), dtype=torch.float32, device=q.device)
    g = out if gate is None else gate  # (unread without a gate)
    _paged_decode_kernel[(num, num_kv, num_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        rows,
        out,
        part,
        lse,
        g,
        kv_scale if fp8 else out,  # (unread without FP8)
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        g.stride(0),
        g.stride(1),
        scale,
        block_size,
        num_heads,
        GROUP=group,
        BG=max(16, triton.next_power_of_2(group)),
        HD=hd,
        BD=bd,
        BN=tile,
        NUM_PARTS=num_parts,
        EXACT=q.dtype == torch.float32 or INTERPRET,
        GATED=gate is not None,
        FP8=fp8,
        num_warps=num_warps or 4,
        # tuned on the H200 (bench/results): two stages win once the grid is large
        num_stages=num_stages or (2 if num * num_kv >= 256 else 3),
        **pdl_options(q, reads_ahead="attention"),
    )
    if num_parts > 1:
        _merge_parts_kernel[(num, num_heads)](
            part,
            lse,
            rows,
            out,
            g,
            out.stride(0),
            out.stride(1),
            g.stride(0),
            g.stride(1),
            num_heads,
            HD=hd,
            BD=bd,
            NUM_PARTS=num_parts,
            BP=triton.next_power_of_2(num_parts),
            GATED=gate is not None,
            num_warps=4,
            **pdl_options(q, reads_ahead="attention"),
        )
