"""The Qwen3.5 text model over one unified step: composes the layer files.

Module names follow the HF text checkpoint (`model.layers.N.linear_attn.in_proj_qkv.weight`,
...), so the loader maps names one to one. Layers repeat DeltaNet x3 then full attention x1
(config.layer_types); every block is pre-norm with a SwiGLU MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.engine.rank.attention import GatedAttention
from deltaserve.engine.rank.batch import StepBatch
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.deltanet import GatedDeltaNet
from deltaserve.engine.rank.embedding import VocabParallelEmbedding
from deltaserve.engine.rank.mlp import MLP
from deltaserve.engine.rank.model_config import ModelConfig
from deltaserve.engine.rank.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = config.layer_types[index] == "linear_attention"
        if self.is_linear:
            cache_layer = config.linear_attention_layers.index(index)
            self.linear_attn = GatedDeltaNet(config, cache_layer, dtype, device)
        else:
            cache_layer = config.full_attention_layers.index(index)
            self.self_attn = GatedAttention(config, cache_layer, dtype, device)
        self.mlp = MLP(hidden, config.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)

    def forward(self, x: torch.Tensor, batch: StepBatch, cache: StateCache) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x = x + mixer(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3_5TextModel(config, dtype, device)
        if not config.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device)

    @property
    def output_embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: StateCache) -> torch.Tensor | None:
        """Run every layer over the step; return fp32 logits [S, vocab] of the tokens at
        `batch.logits_index` on rank 0 (None on the other ranks)."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, batch, cache)
        x = self.model.norm(x[batch.logits_index])
        return self.output_embedding.logits(x)
