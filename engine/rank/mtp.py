"""The multi-token-prediction (MTP) head of the Qwen3.5 checkpoints (`mtp.*`), the draft model
of speculative decoding (engine/rank/speculative.py).

As released (vLLM's `Qwen3_5MultiTokenPredictor`, SGLang's NextN, read and written anew): the
head predicts the token after next from the next token's embedding and the target's final
hidden state at the current position:

    x = fc([pre_fc_norm_embedding(embed(t[p + 1])) | pre_fc_norm_hidden(h[p])])   [2H -> H]
    x = one full-attention decoder layer (its own KV cache, RoPE at position p), MLP or MoE
    g = norm(x);  logits = lm_head(g)   (the target's embedding and lm_head, shared)

Every norm is zero-centred like the model's. Drafting runs the head k times: the first on the
target's hidden state at the last accepted position, each next one on the head's own `g`.

The head's KV cache must hold every position before a draft's, made from the target's hidden
states. So every target forward also writes the head's keys and values of its rows
(`catch_up`): row r (token t at position p) with the target's hidden state at p - 1 fills the
head's position p - 1, from that step's rows, or for a span's first row from the slot's saved
hidden state (`StateCache.hidden`, which every step leaves at the span's last row). Only the
keys and values are needed there, so the catch-up runs fc, the layer's input norm and its
q/k/v projection, not attention or the MLP. Rows a rejected draft wrote are at or past the
next step's first position, rewritten before they are read.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.batch import MtpRows, SeqSpan, StepBatch, StepPlan
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.embedding import VocabParallelEmbedding
from deltaserve.engine.rank.linear import RowParallelLinear
from deltaserve.engine.rank.norm import RMSNorm
from deltaserve.engine.rank.parallel import all_reduce, tp_rank, tp_size
from deltaserve.engine.rank.qwen3_5 import DecoderLayer
from deltaserve.engine.rank.transfer import to_device
from deltaserve.kernels.rope import KVStore, norm_rope
from deltaserve.kernels.triton_compat import gpu_path


class MultiTokenPredictor(nn.Module):
    """`mtp.*` of a checkpoint, sharded under tensor parallelism as the model's layers are: fc
    row-parallel (each rank its columns of the concatenated input), the decoder layer's heads
    and MLP (or experts) split as the target's."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        config.check_mtp_head()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, dtype, device)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, dtype, device)
        self.fc = RowParallelLinear(2 * hidden, hidden, dtype, device)
        self.kv_layer = len(config.full_attention_layers)  # the cache's last KV layer
        self.layers = nn.ModuleList(
            [DecoderLayer(config, 0, dtype, device, kv_layer=self.kv_layer)]
        )
        self.norm = RMSNorm(hidden, eps, dtype, device)

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input [T, H] from each row's token embedding and the target's hidden
        state of the position before (both [T, H], replicated on every rank)."""
        x = torch.cat(
            (self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)), dim=-1
        )  # [T, 2H]
        if tp_size() == 1:
            return self.fc.product(x)
        width = x.shape[-1] // tp_size()
        return all_reduce(self.fc.product(x[:, tp_rank() * width : (tp_rank() + 1) * width]))

    def forward(self, x: torch.Tensor, batch: StepBatch, cache: StateCache) -> torch.Tensor:
        """The decoder layer over the fused rows `x` (their positions, KV rows and spans in
        `batch`), keys and values written and attended: the normed output g [T, H]."""
        h, residual = self.layers[0](x, None, batch, cache)
        g, _ = self.norm.add(h, residual)
        return g

    def store_kv(
        self, x: torch.Tensor, positions: torch.Tensor, kv_index: torch.Tensor, cache: StateCache
    ) -> None:
        """The layer's keys and values of the fused rows `x` at `positions` into its KV rows
        `kv_index` (-1: none): the catch-up, without attention or the MLP."""
        layer = self.layers[0]
        attn = layer.self_attn
        tokens, hd = x.shape[0], attn.head_dim
        q_and_gate, k, v = attn.qkv_proj(layer.input_layernorm(x)).split(
            attn.qkv_proj.local_sizes, dim=-1
        )
        k = k.reshape(tokens, attn.num_kv_heads, hd)
        v = v.reshape(tokens, attn.num_kv_heads, hd)
        k_cache, v_cache = cache.kv[self.kv_layer, 0], cache.kv[self.kv_layer, 1]
        kv_scale = cache.layer_kv_scale(self.kv_layer)  # an FP8 cache: stored as the layer's
        if gpu_path(x) and not cache.calibrating:  # norms, RoPE and the store (row -1: none)
            q = q_and_gate.view(tokens, attn.num_heads, 2 * hd)[..., :hd]
            norm_rope(
                q,
                k,
                attn.q_norm.weight,
                attn.k_norm.weight,
                positions,
                attn.rope.inv_freq,
                attn.q_norm.eps,
                KVStore(v, k_cache, v_cache, kv_index, kv_scale),
            )
            return
        kept = (kv_index >= 0).nonzero()[:, 0]
        k = attn.rope(attn.k_norm(k[kept]), positions[kept])
        # the layer's own store: an FP8 cache's scales calibrated (the step that calibrates),
        # the keys and values quantized as the decoder layer's attention stores them
        attn.store(k, v[kept], k_cache, v_cache, kv_index[kept], cache)

    def catch_up(
        self,
        embed: VocabParallelEmbedding,
        batch: StepBatch,
        cache: StateCache,
        hidden: torch.Tensor,
    ) -> None:
        """After the target's layers over `batch` (final hidden states `hidden` [T, H]): the
        head's keys and values of the positions before the rows (`batch.mtp`), and each span's
        last hidden state into its slot."""
        rows = batch.mtp
        ids = batch.input_ids
        if batch.token_slots is not None:  # a decode graph's rows of the slots' last samples
            ids = torch.where(ids >= 0, ids, cache.last_tokens[batch.token_slots.long()])
        src = rows.hidden_src
        before = torch.where(
            (src >= 0)[:, None],
            hidden[src.clamp(min=0)],
            cache.hidden[(-1 - src).clamp(min=0)],
        )
        x = self.fuse(embed(ids), before)
        self.store_kv(x, batch.positions - 1, rows.kv_index, cache)
        cache.hidden[rows.last_slots] = hidden[rows.last_rows]


def mtp_rows(plan: StepPlan, block_size: int, device: torch.device) -> MtpRows:
    """`MtpRows` of an eager step from its plan (`mtp_row_lists`)."""
    return MtpRows(
        *(to_device(values, torch.int64, device) for values in mtp_row_lists(plan, block_size))
    )


def mtp_row_lists(
    plan: StepPlan, block_size: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """`MtpRows`' fields of a step as host lists: each span's first row takes the slot's saved
    hidden state and writes the head's keys at position start - 1 (none at a prompt's start),
    the other rows the row before's."""
    kv_index, hidden_src, last_rows, last_slots = [], [], [], []
    for span in plan.spans:
        first = span.start - 1
        kv_index.append(
            -1 if first < 0 else span.blocks[first // block_size] * block_size + first % block_size
        )
        hidden_src.append(-1 - span.slot)
        rows = range(span.offset + 1, span.offset + span.length)
        kv_index.extend(plan.kv_rows[r - 1] for r in rows)
        hidden_src.extend(r - 1 for r in rows)
        last_rows.append(span.offset + span.length - 1)
        last_slots.append(span.slot)
    return kv_index, hidden_src, last_rows, last_slots


def draft_batch(
    spans: list[SeqSpan],
    positions: list[int],
    kv_rows: list[int],
    device: torch.device,
) -> StepBatch:
    """The head's step over one row per drafting request (span i its row i at positions[i])."""
    return StepBatch(
        input_ids=torch.empty(0, dtype=torch.int64, device=device),  # the rows come fused
        positions=to_device(positions, torch.int64, device),
        kv_index=to_device(kv_rows, torch.int64, device),
        spans=tuple(spans),
        logits_index=None,
    )
