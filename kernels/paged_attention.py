"""Causal GQA attention over a paged KV cache, plain torch.

The cache is flat: row `block * block_size + offset` holds one position of one request. A span
of L queries at positions start .. start+L-1 attends to its request's positions 0 .. its own.
"""

from __future__ import annotations

import torch


def request_rows(block_table: torch.Tensor, block_size: int, num_positions: int) -> torch.Tensor:
    """Cache rows of positions 0 .. num_positions-1 of a request, in order."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[:, None] * block_size + offsets).flatten()[:num_positions]


def paged_attention(
    q: torch.Tensor,  # [L, nh, hd], one request's queries
    k_cache: torch.Tensor,  # [rows, nkv, hd]
    v_cache: torch.Tensor,  # [rows, nkv, hd]
    block_table: torch.Tensor,  # [blocks] int64
    block_size: int,
    start: int,  # position of q[0]
    scale: float,
) -> torch.Tensor:  # [L, nh, hd]
    length, num_heads, _ = q.shape
    rows = request_rows(block_table, block_size, start + length)
    k, v = k_cache[rows], v_cache[rows]  # [P, nkv, hd]
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,phd->hlp", q, k).float() * scale
    query_pos = torch.arange(start, start + length, device=q.device)[:, None]
    key_pos = torch.arange(start + length, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.einsum("hlp,phd->lhd", probs, v)
