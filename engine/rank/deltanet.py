"""Gated DeltaNet (linear attention) layer of Qwen3.5, heads split across ranks.

in_proj_qkv rows are [Q all key heads | K all key heads | V all value heads]; each section is
split by heads, so a rank holds matching Q, K, V (and conv channels, z, a, b, A_log, dt_bias)
of its heads. Per request the layer keeps a conv window and a recurrent state (fp32, or bf16
with --mamba-ssm-cache-dtype bfloat16; updated in fp32 either way) in the request's slot of the
StateCache.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.batch import StepBatch
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    new_param,
    sharded_loader,
)
from deltaserve.engine.rank.norm import GatedRMSNorm
from deltaserve.engine.rank.parallel import tp_size
from deltaserve.engine.rank.step_meta import step_meta_of
from deltaserve.kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_prefill,
    causal_conv1d_update,
)
from deltaserve.kernels.gated_delta import (
    CHUNK_SIZE,
    chunk_gated_delta,
    delta_rule_inputs,
    gated_delta_decode,
    gated_delta_prefill,
    recurrent_gated_delta,
)
from deltaserve.kernels.skinny_linear import ConvEpilogue, SplitSum
from deltaserve.kernels.triton_compat import gpu_path


class Conv1dWeight(nn.Module):
    """Holds `conv1d.weight` [channels, 1, width] under its checkpoint name."""

    def __init__(
        self, sections: tuple[int, ...], width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        channels = sum(sections)
        loader = sharded_loader(sections, 0, (channels, 1, width))
        self.weight = new_param((channels // tp_size(), 1, width), loader, dtype, device)


class GatedDeltaNet(nn.Module):
    def __init__(
        self, config: ModelConfig, cache_layer: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        tp = tp_size()
        hidden = config.hidden_size
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dv = config.linear_value_head_dim
        self.num_k_heads, self.num_v_heads = nk // tp, nv // tp
        self.cache_layer = cache_layer
        sections = (config.linear_key_dim, config.linear_key_dim, config.linear_value_dim)
        # checkpoint in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        self.in_proj = ColumnParallelLinear(
            hidden, (sections, (config.linear_value_dim,), (nv,), (nv,)), dtype, device
        )
        self.conv1d = Conv1dWeight(sections, config.linear_conv_kernel_dim, dtype, device)
        self.A_log = new_param((nv // tp,), sharded_loader(None, 0, (nv,)), dtype, device)
        self.dt_bias = new_param((nv // tp,), sharded_loader(None, 0, (nv,)), dtype, device)
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps, dtype, device)
        self.out_proj = RowParallelLinear(config.linear_value_dim, hidden, dtype, device)

    def forward(
        self, x: torch.Tensor, batch: StepBatch, cache: StateCache
    ) -> torch.Tensor | SplitSum:
        if gpu_path(x):
            return self._forward_cuda(x, batch, cache)
        tokens = x.shape[0]
        nk, nv, dv = self.num_k_heads, self.num_v_heads, self.dv
        qkv, z, b, a = self.in_proj(x).split(self.in_proj.local_sizes, dim=-1)  # qkv: conv channels
        z = z.reshape(tokens, nv, dv)

        conv_state = cache.conv[self.cache_layer]  # [slots, channels, width - 1]
        recurrent = cache.recurrent[self.cache_layer]  # [slots, nv, dk, dv]
        weight = self.conv1d.weight[:, 0]
        mixed = torch.empty_like(qkv)
        for span in batch.spans:
            piece = slice(span.offset, span.offset + span.length)
            mixed[piece] = causal_conv1d(qkv[piece], weight, conv_state[span.slot])
        q, k, v, g, beta = delta_rule_inputs(mixed, a, b, self.A_log, self.dt_bias, nk, dv)

        core = torch.empty((tokens, nv, dv), dtype=torch.float32, device=x.device)
        decodes = [s for s in batch.spans if s.length == 1]
        if decodes:  # one batched recurrent step for every single-token span
            rows = torch.tensor([s.offset for s in decodes], device=x.device)
            slots = torch.tensor([s.slot for s in decodes], device=x.device)
            state = recurrent[slots]
            core[rows] = recurrent_gated_delta(
                q[rows], k[rows], v[rows], g[rows], beta[rows], state
            )
            recurrent[slots] = state
        for span in batch.spans:
            if span.length > 1:
                piece = slice(span.offset, span.offset + span.length)
                state = recurrent[span.slot]
                core[piece] = chunk_gated_delta(
                    q[piece],
                    k[piece],
                    v[piece],
                    g[piece],
                    beta[piece],
                    state.clone() if span.verify else state,  # verify: rolled forward later
                )
        if batch.stash is not None:
            batch.stash.keep(self.cache_layer, qkv, mixed, a, b)
        out = self.norm(core.to(x.dtype), z)
        return self.out_proj(out.reshape(tokens, nv * dv))

    def _forward_cuda(
        self, x: torch.Tensor, batch: StepBatch, cache: StateCache
    ) -> torch.Tensor | SplitSum:
        """Decode items: the conv made by in_proj's kernel (a decode-only step) or one conv
        kernel, and one fused recurrent kernel for all of them, state updated in place in its
        slot. Prefill spans: the conv, then fla's chunked kernel over all of them packed (the
        torch reference when fla is absent)."""
        tokens = x.shape[0]
        nk, nv, dv = self.num_k_heads, self.num_v_heads, self.dv
        meta = step_meta_of(batch, x.device)
        conv_state = cache.conv[self.cache_layer]  # [slots, channels, width - 1]
        recurrent = cache.recurrent[self.cache_layer]  # [slots, nv, dk, dv]
        weight = self.conv1d.weight[:, 0]
        if meta.packed is None:  # decodes only: row r is decode r
            conv = ConvEpilogue(weight, conv_state, meta.rows, meta.slots)
            mixed, z, b, a = self.in_proj(x, conv=conv).split(self.in_proj.local_sizes, dim=-1)
        else:
            # b, a raw: in the kernel
            qkv, z, b, a = self.in_proj(x).split(self.in_proj.local_sizes, dim=-1)
            mixed = torch.empty_like(qkv)
            if meta.num_decodes:
                causal_conv1d_update(qkv, weight, conv_state, meta.rows, meta.slots, mixed)
        z = z.reshape(tokens, nv, dv)
        core = torch.empty((tokens, nv, dv), dtype=x.dtype, device=x.device)
        if meta.num_decodes:
            gated_delta_decode(
                mixed, a, b, self.A_log, self.dt_bias, recurrent, meta.rows, meta.slots, core, nk
            )
        if meta.packed is not None:
            packed = meta.packed
            offsets, lengths, slots = packed.index
            causal_conv1d_prefill(
                qkv, weight, conv_state, offsets, lengths, slots, packed.blocks, CHUNK_SIZE, mixed
            )
            prefill = (self.A_log, self.dt_bias, recurrent, slots, packed.bounds, packed.blocks, nk)
            store = {"store_slots": packed.store_slots}  # verify spans' states: not written
            if meta.num_decodes:  # prompt rows packed apart from the decode rows
                rows = meta.prefill_rows
                core[rows] = gated_delta_prefill(mixed[rows], a[rows], b[rows], *prefill, **store)
            else:  # every row is a prompt row, already packed (rows past the last span: padding)
                core = gated_delta_prefill(mixed, a, b, *prefill, **store)
            if batch.stash is not None:
                batch.stash.keep(self.cache_layer, qkv, mixed, a, b)
        out = self.norm(core, z)
        return self.out_proj(out.reshape(tokens, nv * dv))
