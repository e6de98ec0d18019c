"""The Qwen3.5 text model over one unified step: composes the layer files.

Module names follow the HF text checkpoint (`model.layers.N.linear_attn.in_proj_qkv.weight`,
...), so the loader maps names one to one. Layers repeat DeltaNet x3 then full attention x1
(config.layer_types); every block is pre-norm with a SwiGLU MLP (in the MoE models, routed
experts and a shared one: moe.py). Projections of the same
input run as one GEMM (`packed_modules`); the residual add runs inside the next norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.attention import GatedAttention
from deltaserve.engine.rank.batch import StepBatch
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.deltanet import GatedDeltaNet
from deltaserve.engine.rank.embedding import VocabParallelEmbedding
from deltaserve.engine.rank.mlp import MLP
from deltaserve.engine.rank.moe import SparseMoeBlock
from deltaserve.engine.rank.norm import RMSNorm
from deltaserve.kernels.skinny_linear import SplitSum

if TYPE_CHECKING:
    from deltaserve.engine.rank.mtp import MultiTokenPredictor

# checkpoint module -> (our merged module, part): one GEMM where HF runs several
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_layer: int | None = None,
    ) -> None:
        """Layer `index` of the model, or with `kv_layer` a full-attention layer whose keys and
        values are that layer of the cache (the MTP head's, engine/rank/mtp.py)."""
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = kv_layer is None and config.layer_types[index] == "linear_attention"
        if self.is_linear:
            cache_layer = config.linear_attention_layers.index(index)
            self.linear_attn = GatedDeltaNet(config, cache_layer, dtype, device)
        else:
            if kv_layer is None:
                kv_layer = config.full_attention_layers.index(index)
            self.self_attn = GatedAttention(config, kv_layer, dtype, device)
        if config.num_experts:
            self.mlp = SparseMoeBlock(config, dtype, device)
        else:
            self.mlp = MLP(hidden, config.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor | SplitSum,
        residual: torch.Tensor | None,
        batch: StepBatch,
        cache: StateCache,
    ) -> tuple[torch.Tensor | SplitSum, torch.Tensor]:
        """(this block's MLP output, the residual stream before it): the caller's next norm
        adds the two (HF: x = x + mixer(norm(x)); x = x + mlp(norm(x))). A projection's output
        may be its unsummed parts (`SplitSum`): only a norm's add takes it."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(mixer(h, batch, cache), residual)
        return self.mlp(h), residual


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype, device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class Qwen3_5ForCausalLM(nn.Module):
    packed_modules = PACKED_MODULES

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        mtp: MultiTokenPredictor | None = None,
    ) -> None:
        """`mtp`: the checkpoint's multi-token-prediction head (speculative decoding), loaded
        as `mtp.*`; every forward then writes its keys and values of the step's rows."""
        super().__init__()
        self.config = config
        self.model = Qwen3_5TextModel(config, dtype, device)
        if not config.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, dtype, device
            )
        self.mtp = mtp

    @property
    def output_embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: StateCache) -> torch.Tensor | None:
        """Run every layer over the step; return fp32 logits [S, vocab] of the tokens at
        `batch.logits_index` (every token where it is None) on rank 0 (None on the others)."""
        return self.logits(self.hidden_states(batch, cache), batch)

    def logits(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """The fp32 logits of `hidden`'s rows at `batch.logits_index` (all where None), rank 0."""
        return self.output_embedding.logits(
            hidden if batch.logits_index is None else hidden[batch.logits_index]
        )

    @torch.inference_mode()
    def hidden_states(self, batch: StepBatch, cache: StateCache) -> torch.Tensor:
        """Run every layer over the step; every token's final hidden state [T, hidden], normed."""
        # [T, hidden]
        x = self.model.embed_tokens(batch.input_ids, batch.token_slots, cache.last_tokens)
        if batch.vision is not None:  # images' tokens: the vision tower's embeddings
            x = batch.vision.embed(x)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, batch, cache)
        x, _ = self.model.norm.add(x, residual)  # every row: x may be a projection's partial sums
        if self.mtp is not None and batch.mtp is not None:
            self.mtp.catch_up(self.model.embed_tokens, batch, cache, x)
        if batch.stash is not None:  # a verify step's: the drafts' rows (speculative.py)
            batch.stash.keep_hidden(x)
        return x
