"""The MTP head (engine/rank/mtp.py) against a reference written here from the published
architecture (Qwen3-Next / Qwen3.5's multi-token prediction, as vLLM's qwen3_5_mtp describes
it; transformers has no MTP module): fc over [norm(embed(next token)) | norm(hidden)], one
gated full-attention decoder layer with its SwiGLU MLP, the head's final norm, the shared
lm_head. Plain torch over the checkpoint's own tensors, fp32, on the CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltaserve.engine.model_config import ModelConfig
from deltaserve.engine.rank.batch import SeqSpan
from deltaserve.engine.rank.cache import StateCache
from deltaserve.engine.rank.loader import load_weights
from deltaserve.engine.rank.mtp import MultiTokenPredictor, draft_batch
from deltaserve.engine.rank.qwen3_5 import Qwen3_5ForCausalLM
from deltaserve.kernels.kv_quant import FP8
from deltaserve.tools.make_model import make_model

POSITIONS = 21  # past one KV block of 16
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny, fp32, with a random MTP head (its norms not at zero, as make_model draws them)."""
    return make_model(tmp_path_factory.mktemp("mtp"), preset="tiny", dtype="fp32", mtp="random")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary: int) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary` dims of each head ([T, heads, hd])."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)
    angles = positions[:, None].float() * inv_freq  # [T, rotary / 2]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    head, rest = x[..., :rotary], x[..., rotary:]
    first, second = head.chunk(2, dim=-1)
    return torch.cat((head * cos + torch.cat((-second, first), -1) * sin, rest), -1)


def reference_logits(
    w: dict[str, torch.Tensor], c: ModelConfig, next_tokens: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """[T, vocab]: the head at positions 0 .. T-1, row p from the embedding of the token at
    p + 1 and the target's hidden state at p, attending causally over the rows before it."""
    eps, hd = c.rms_norm_eps, c.head_dim
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    embed = w["model.embed_tokens.weight"]
    lm_head = embed if c.tie_word_embeddings else w["lm_head.weight"]
    layer = {k.removeprefix("mtp.layers.0."): v for k, v in w.items() if "mtp.layers.0." in k}
    x = (
        torch.cat(
            (
                rms_norm(embed[next_tokens], w["mtp.pre_fc_norm_embedding.weight"], eps),
                rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps),
            ),
            -1,
        )
        @ w["mtp.fc.weight"].T
    )
    t = x.shape[0]
    positions = torch.arange(t)
    a = rms_norm(x, layer["input_layernorm.weight"], eps)
    q_gate = (a @ layer["self_attn.q_proj.weight"].T).view(t, nh, 2 * hd)
    q, gate = q_gate[..., :hd], q_gate[..., hd:]
    k = (a @ layer["self_attn.k_proj.weight"].T).view(t, nkv, hd)
    v = (a @ layer["self_attn.v_proj.weight"].T).view(t, nkv, hd)
    rotary = int(hd * c.partial_rotary_factor)
    q = rotate(rms_norm(q, layer["self_attn.q_norm.weight"], eps), positions, c.rope_theta, rotary)
    k = rotate(rms_norm(k, layer["self_attn.k_norm.weight"], eps), positions, c.rope_theta, rotary)
    group = nh // nkv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v) * torch.sigmoid(gate)
    x = x + attn.reshape(t, nh * hd) @ layer["self_attn.o_proj.weight"].T
    m = rms_norm(x, layer["post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(m @ layer["mlp.gate_proj.weight"].T) * (
        m @ layer["mlp.up_proj.weight"].T
    )
    x = x + mlp @ layer["mlp.down_proj.weight"].T
    return rms_norm(x, w["mtp.norm.weight"], eps) @ lm_head.T


def test_the_head_matches_the_published_architecture(mtp_model_dir):
    """Drafting steps one position at a time (the head's own KV cache, across a block), and
    the catch-up that writes the head's keys from the target's rows, both give the
    reference's logits."""
    torch.manual_seed(0)
    config = ModelConfig.from_model_dir(mtp_model_dir)
    cpu = torch.device("cpu")
    model = Qwen3_5ForCausalLM(
        config, torch.float32, cpu, MultiTokenPredictor(config, torch.float32, cpu)
    )
    load_weights(model, mtp_model_dir, config)
    weights = load_file(str(mtp_model_dir / "model.safetensors"))
    assert any(name.startswith("mtp.layers.0.mlp") for name in weights)
    next_tokens = torch.randint(0, 1000, (POSITIONS,))
    hidden = torch.randn(POSITIONS, config.hidden_size)
    want = reference_logits(weights, config, next_tokens, hidden)

    head = model.mtp
    blocks = [2, 0]  # out of order: the block table is followed
    table = torch.tensor(blocks, dtype=torch.int64)
    for catch_up in (False, True):
        cache = StateCache(config, 1, 4, BLOCK_SIZE, 1, torch.float32, cpu, mtp=True)
        kv_rows = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(POSITIONS)]
        x = head.fuse(model.model.embed_tokens(next_tokens), hidden)
        first = POSITIONS - 1 if catch_up else 0
        if catch_up:  # the earlier positions' keys as a target step writes them
            head.store_kv(x[:first], torch.arange(first), torch.tensor(kv_rows[:first]), cache)
        for p in range(first, POSITIONS):
            batch = draft_batch([SeqSpan(0, 1, p, 0, table, blocks)], [p], [kv_rows[p]], cpu)
            got = model.output_embedding.logits(head(x[p : p + 1], batch, cache))
            torch.testing.assert_close(got[0], want[p], atol=2e-4, rtol=1e-4)


def test_the_catch_up_stores_the_heads_keys_in_an_fp8_cache_as_its_attention_does(
    mtp_model_dir,
):
    """--kv-cache-dtype fp8: the head's KV layer is the cache's like the target's. The
    catch-up calibrates its scales in the step that calibrates, and stores a row's keys and
    values quantized exactly as a draft step's attention stores the same row."""
    config = ModelConfig.from_model_dir(mtp_model_dir)
    cpu = torch.device("cpu")
    model = Qwen3_5ForCausalLM(
        config, torch.float32, cpu, MultiTokenPredictor(config, torch.float32, cpu)
    )
    load_weights(model, mtp_model_dir, config)
    head = model.mtp
    cache = StateCache(config, 1, 2, BLOCK_SIZE, 1, torch.float32, cpu, kv_dtype=FP8, mtp=True)
    torch.manual_seed(0)
    x = head.fuse(model.model.embed_tokens(torch.tensor([5])), torch.randn(1, config.hidden_size))
    cache.calibrating = True  # as the executor sets it for the first prompt step
    head.store_kv(x, torch.tensor([0]), torch.tensor([0]), cache)  # block 0's first row
    cache.calibrating = False
    assert (cache.kv_scale[head.kv_layer] != 1.0).all()
    table = torch.tensor([1], dtype=torch.int64)
    head(x, draft_batch([SeqSpan(0, 1, 0, 0, table, [1])], [0], [BLOCK_SIZE], cpu), cache)
    stored = cache.kv[head.kv_layer].view(torch.uint8)  # [k|v, rows, heads, hd]
    assert stored[:, 0].any() and torch.equal(stored[:, 0], stored[:, BLOCK_SIZE])


def test_an_moe_head_loads_from_the_released_layout(tmp_path):
    """The MoE models' head (experts one by one, `mtp.*` beside `model.language_model.*`)
    loads whole: a tensor missing or left over would raise."""
    model_dir = make_model(tmp_path, preset="tiny-moe", dtype="fp32", mtp="random", vlm_names=True)
    config = ModelConfig.from_model_dir(model_dir)
    cpu = torch.device("cpu")
    head = MultiTokenPredictor(config, torch.float32, cpu)
    model = Qwen3_5ForCausalLM(config, torch.float32, cpu, head)
    for param in head.parameters():
        param.data.fill_(float("nan"))
    load_weights(model, model_dir, config)
    assert "layers.0.mlp.experts.gate_up_proj" in dict(head.named_parameters())
    assert all(not param.isnan().any() for param in head.parameters())
