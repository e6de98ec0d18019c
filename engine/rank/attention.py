"""Gated full attention of Qwen3.5, heads split across ranks.

q_proj yields, per head, [query | gate] (so it splits on head boundaries); per-head zero-centred
q/k norms; RoPE (rotate-half) on the first `rotary_dim` dims only; causal GQA attention over the
paged cache; output times sigmoid(gate), then the row-parallel o_proj. With an FP8 cache
(kernels/kv_quant.py) keys and values are stored quantized, read back multiplied by their
scales, and a prompt's fresh keys go through the same round trip: it attends to what a later
chunk or a decode step reads from the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.batch import StepBatch
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.engine.rank.norm import RMSNorm
from deltaserve.engine.rank.parallel import tp_size
from deltaserve.engine.rank.step_meta import step_meta_of
from deltaserve.kernels.activation import sigmoid_gate
from deltaserve.kernels.kv_quant import quantize, round_trip
from deltaserve.kernels.paged_attention import (
    gathered_prefill_attention,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_attention,
    varlen_prefill_attention,
)
from deltaserve.kernels.rope import KVStore, norm_rope
from deltaserve.kernels.skinny_linear import SplitSum
from deltaserve.kernels.triton_compat import gpu_path


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Rope:
    """Rotary position embedding on the leading `rotary_dim` dims of each head."""

    def __init__(self, rotary_dim: int, theta: float, device: torch.device) -> None:
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
        self.inv_freq = 1.0 / (theta**exponents)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, hd]; positions [T], or [T, rotary_dim / 2] (one per frequency: MRoPE);
        # cos/sin computed in fp32 and cast, as HF does
        if positions.dim() == 1:
            positions = positions[:, None]
        freqs = positions.float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


class GatedAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, cache_layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        tp = tp_size()
        hd = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_key_value_heads // tp
        self.head_dim = hd
        self.cache_layer = cache_layer
        hidden = config.hidden_size
        kv_rows = (config.num_key_value_heads * hd,)
        self.qkv_proj = ColumnParallelLinear(  # checkpoint q_proj, k_proj, v_proj
            hidden, ((config.num_attention_heads * 2 * hd,), kv_rows, kv_rows), dtype, device
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, hidden, dtype, device)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype, device)
        self.rope = Rope(config.rotary_dim, config.rope_theta, device)

    def forward(
        self, x: torch.Tensor, batch: StepBatch, cache: StateCache
    ) -> torch.Tensor | SplitSum:
        tokens = x.shape[0]
        hd = self.head_dim
        q_and_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        q_and_gate = q_and_gate.view(tokens, self.num_heads, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:]
        k = k.view(tokens, self.num_kv_heads, hd)
        v = v.view(tokens, self.num_kv_heads, hd)
        k_cache, v_cache = cache.kv[self.cache_layer, 0], cache.kv[self.cache_layer, 1]
        attend = self._attend_cuda if gpu_path(x) else self._attend_reference
        out = attend(q, gate, k, v, k_cache, v_cache, batch, cache)
        return self.o_proj(out.reshape(tokens, self.num_heads * hd))

    def _attend_reference(
        self,
        q: torch.Tensor,  # [T, nh, hd]
        gate: torch.Tensor,  # [T, nh, hd], the output gate
        k: torch.Tensor,  # [T, nkv, hd]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [rows, nkv, hd]
        v_cache: torch.Tensor,
        batch: StepBatch,
        cache: StateCache,
    ) -> torch.Tensor:
        """The plain torch path (CPU): q/k norms and RoPE, K/V stored, each span attended, the
        output gated."""
        positions = batch.positions if batch.vision is None else batch.vision.rope_positions
        q = self.rope(self.q_norm(q), positions)
        k = self.rope(self.k_norm(k), positions)
        kv_scale = self.store(k, v, k_cache, v_cache, batch.kv_index, cache)
        out = torch.empty_like(q)
        for span in batch.spans:
            piece = slice(span.offset, span.offset + span.length)
            out[piece] = paged_attention(
                q[piece],
                k_cache,
                v_cache,
                span.block_table,
                cache.block_size,
                span.start,
                self.head_dim**-0.5,
                kv_scale,
            )
        return sigmoid_gate(out, gate)

    def store(
        self,
        k: torch.Tensor,  # [T, nkv, hd], normed and rotated
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_index: torch.Tensor,
        cache: StateCache,
    ) -> torch.Tensor | None:
        """Keys and values into the cache rows (an FP8 cache's quantized, its scales first
        calibrated on them if the step calibrates); returns this layer's scales, or None."""
        kv_scale = cache.layer_kv_scale(self.cache_layer)
        if kv_scale is None:
            k_cache[kv_index] = k
            v_cache[kv_index] = v
            return None
        if cache.calibrating:
            cache.calibrate(self.cache_layer, k, v)
        k_cache[kv_index] = quantize(k, kv_scale[0])
        v_cache[kv_index] = quantize(v, kv_scale[1])
        return kv_scale

    def _attend_cuda(
        self,
        q: torch.Tensor,  # [T, nh, hd]
        gate: torch.Tensor,  # [T, nh, hd]
        k: torch.Tensor,  # [T, nkv, hd]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [rows, nkv, hd]
        v_cache: torch.Tensor,
        batch: StepBatch,
        cache: StateCache,
    ) -> torch.Tensor:
        """q/k norms and RoPE and the K/V store in one kernel; all decode items in one
        paged-attention launch, gated in it; prompts' first chunks alone in one varlen flash
        launch, else each prefill span through `prefill_attention` (flash on the GPU), each
        then gated by `sigmoid_gate`."""
        meta = step_meta_of(batch, q.device)
        kv_scale = cache.layer_kv_scale(self.cache_layer)
        # with images, three positions a token (MRoPE), each frequency turning by one of them
        vision = batch.vision
        positions, axis = (
            (batch.positions, None) if vision is None else (vision.rope_rows, vision.axis)
        )
        norms = (self.q_norm.weight, self.k_norm.weight, positions, self.rope.inv_freq)
        if cache.calibrating:  # one eager step: the scales from its keys, then the store
            q, k = norm_rope(q, k, *norms, self.q_norm.eps, axis=axis)
            self.store(k, v, k_cache, v_cache, batch.kv_index, cache)
        else:
            store = KVStore(v, k_cache, v_cache, batch.kv_index, kv_scale)
            q, k = norm_rope(q, k, *norms, self.q_norm.eps, store, axis)
        if kv_scale is not None:  # fresh keys as the cache gives them back
            k, v = round_trip(k, kv_scale[0]), round_trip(v, kv_scale[1])
        scale = self.head_dim**-0.5
        # a verify graph's rows attend as decode rows, each to its own position
        packed = meta.packed if meta.attend_rows is None else None
        if (
            packed is not None and packed.keys is not None
        ):  # a prompt graph's chunks, maybe after cached positions
            attended = gathered_prefill_attention(
                q,
                k_cache,
                v_cache,
                packed.bounds,
                packed.keys,
                packed.max_len,
                cache.block_size,
                scale,
                kv_scale,
            )
            return sigmoid_gate(attended, gate)
        if (
            packed is not None and packed.fresh and not meta.num_decodes
        ):  # every row a prompt's, from its start
            return sigmoid_gate(
                varlen_prefill_attention(q, k, v, packed.bounds, packed.max_len, scale), gate
            )
        out = torch.empty_like(q)
        decodes = meta.attend_rows
        if decodes is None and meta.num_decodes:
            decodes = (meta.rows, meta.seq_lens, meta.block_tables)
        if decodes is not None:  # gated in the kernel
            rows, seq_lens, tables = decodes
            paged_decode_attention(
                q,
                k_cache,
                v_cache,
                tables,
                seq_lens,
                rows,
                cache.block_size,
                scale,
                out,
                meta.max_seq_len,
                gate=gate,
                kv_scale=kv_scale,
            )
        for span in meta.prefill:
            piece = slice(span.offset, span.offset + span.length)
            if span.start == 0:  # a prompt's first chunk: its keys are all fresh, no cache gather
                attended = prefill_attention(q[piece], k[piece], v[piece], 0, scale)
            else:
                attended = paged_prefill_attention(
                    q[piece],
                    k_cache,
                    v_cache,
                    span.block_table,
                    cache.block_size,
                    span.start,
                    scale,
                    kv_scale,
                )
            out[piece] = sigmoid_gate(attended.contiguous(), gate[piece])
        return out
