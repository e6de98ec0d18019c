"""Gated delta rule: the DeltaNet recurrence, in a chunked form for prefill and a per-token
form for decode. Plain torch references; the GPU kernels are checked against these.

Per value head, with state S [dk, dv] (fp32), for each token t:

    S <- exp(g_t) S
    u_t = beta_t (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t

q and k arrive L2-normalised, q already scaled by dk^-0.5. Key head h serves value heads
h * r ... h * r + r - 1 (r = value heads / key heads), i.e. value head j reads key head j // r.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64


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
    state: torch.Tensor,  # [B, nv, dk, dv] fp32, updated in place
) -> torch.Tensor:  # [B, nv, dv] fp32
    """One token for each of B sequences (the decode step)."""
    nv = v.shape[1]
    q = _expand_key_heads(q, nv).float()
    k = _expand_key_heads(k, nv).float()
    s = state * g.float().exp()[..., None, None]
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
    state: torch.Tensor,  # [nv, dk, dv] fp32, the state before token 0; updated in place
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
