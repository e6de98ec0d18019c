"""Write a random Qwen3.5 checkpoint in the real format: HF names, config, tokenizer.

No weights can be downloaded here. A random checkpoint of a published shape exercises every
code path and every byte of a real model's cost (DESIGN.md section 3). The names and shapes
come from transformers' own classes (built on the meta device); the values are drawn here,
tensor by tensor, so a 9B checkpoint never sits twice in memory and HF's slow init is skipped.

Values are chosen so that mistakes show:
- every zero-centred RMSNorm weight is random around 0 (HF init: exactly 0, which hides a
  missing "+1"); the DeltaNet gated norm (plain `w`) is random around 1;
- A_log spans slow and fast decays and dt_bias is random (HF init: 1), so some DeltaNet heads
  remember across chunk boundaries;
- projections are drawn with std 1/sqrt(fan_in) (= 0.02 at real widths), so every block moves
  the residual stream at tiny widths too;
- next-token distributions are peaked like a trained model's: logits have std ~8 over the
  vocabulary (mean top-1 probability ~0.5 on random prompts) through the embedding scale and
  the final norm's gain.

Usage (from the repository root):
    python -m tools.make_model --preset tiny --out /tmp/tiny
    python -m tools.make_model --preset 4b --out /tmp/q4b --dtype bf16 --device cuda
    python -m tools.make_model --preset 4b --out /tmp/q4b-fp8 --dtype fp8 --device cuda
    python -m tools.make_model --preset 35b-a3b --layers 8 --out /tmp/moe --dtype bf16 --device cuda

`--dtype fp8` writes an FP8 release as Qwen's `-FP8` checkpoints are laid out: the decoder
layers' projections (but the DeltaNet's 1-row-per-head in_proj_a / in_proj_b) as float8_e4m3fn in
blocks of `--fp8-block` squared, each with its fp32 `weight_scale_inv`; everything else bf16.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from deltaserve.tools.tokenizer_files import qwen_special_tokens, write_tokenizer_files

EOS_TOKEN_IDS = [248046, 248044]  # <|im_end|>, <|endoftext|>
PAD_TOKEN_ID = 248044

_COMMON = dict(
    vocab_size=248320,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
)


def _published(hidden, layers, heads, kv_heads, lin_k, lin_v, inter, tied) -> dict:
    return dict(
        _COMMON,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        linear_num_key_heads=lin_k,
        linear_num_value_heads=lin_v,
        intermediate_size=inter,
        tie_word_embeddings=tied,
    )


PRESETS: dict[str, dict] = {
    "tiny": dict(
        _COMMON,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    # DESIGN.md section 3, published shapes.
    "0.8b": _published(1024, 24, 8, 2, 16, 16, 3584, True),
    "2b": _published(2048, 24, 8, 2, 16, 16, 6144, True),
    "4b": _published(2560, 32, 16, 4, 16, 32, 9216, True),
    "9b": _published(4096, 32, 16, 4, 16, 32, 12288, False),
}


def _moe(dense: dict, experts: int, top_k: int, inter: int, shared_inter: int) -> dict:
    """A mixture-of-experts model (model_type qwen3_5_moe) of `dense`'s shape: experts in place
    of its MLP, so no intermediate_size."""
    return {k: v for k, v in dense.items() if k != "intermediate_size"} | dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=shared_inter,
    )


PRESETS["tiny-moe"] = _moe(PRESETS["tiny"], 8, 2, 32, 48)
PRESETS["35b-a3b"] = _moe(_published(2048, 40, 16, 2, 16, 32, 0, False), 256, 8, 512, 512)


def is_moe(text: dict) -> bool:
    return "num_experts" in text


def hf_classes(moe: bool) -> tuple[type, type, type, type]:
    """transformers' (text config, causal LM, VLM config, VLM) classes of the dense or MoE model."""
    import transformers as hf

    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    return tuple(
        getattr(hf, prefix + name)
        for name in ("TextConfig", "ForCausalLM", "Config", "ForConditionalGeneration")
    )


def hf_causal_lm(model_dir: str | Path) -> type:
    """transformers' causal-LM class for a checkpoint folder (dense or MoE, by its config)."""
    with open(Path(model_dir) / "config.json") as f:
        return hf_classes(json.load(f).get("model_type", "").startswith("qwen3_5_moe"))[1]


DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8": torch.bfloat16,
}  # fp8: the unquantized tensors'
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_QUANTIZED = re.compile(
    r"layers\.\d+\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.((experts\.\d+|shared_expert)\.)?(gate|up|down)_proj)\.weight$"
)
FP8_NOT_CONVERTED = [
    "lm_head",
    "embed_tokens",
    "in_proj_a",
    "in_proj_b",
    "visual",
    "mtp.fc",
    "mlp.gate",
    "shared_expert_gate",
]

# Scales (see the module docstring). Logit std = EMBED_NORM * FINAL_NORM_GAIN.
EMBED_NORM = 2.0  # expected L2 norm of an embedding row
FINAL_NORM_GAIN = 4.0  # mean of (1 + w) of the final norm
NORM_NOISE_STD = 0.2
PADDING_ROW_SCALE = 0.01  # embedding rows past the tokenizer's ids: near zero, never sampled
BLOCK_ELEMENTS = 1 << 22  # values drawn per generator: fixed, so values do not depend on threads


def parse_size(value: str | int) -> int:
    """Bytes from 123, "50MB", "1.5GB", "64MiB" (decimal units as HF's max_shard_size)."""
    if isinstance(value, int):
        size = value
    else:
        units = {
            "": 1,
            "B": 1,
            "KB": 10**3,
            "MB": 10**6,
            "GB": 10**9,
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
        }
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).upper() not in units:
            raise ValueError(f"shard_size {value!r} is not a size like 50MB, 2GB or 1048576")
        size = int(float(match.group(1)) * units[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"shard_size must be positive, got {value!r}")
    return size


def text_config_dict(preset: str, overrides: dict | None = None) -> dict:
    """Keyword arguments of Qwen3_5TextConfig (Qwen3_5MoeTextConfig) for a preset, with
    `overrides` applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    params = dict(PRESETS[preset])
    known = set(hf_classes(is_moe(params))[0].__annotations__) | {
        "rope_theta",
        "partial_rotary_factor",
    }
    for key in overrides or {}:
        if key not in known:
            raise ValueError(f"overrides: unknown text config field {key!r}")
    params.update(overrides or {})
    num_specials = len(qwen_special_tokens())
    min_vocab = qwen_special_tokens()[0][0] + num_specials
    if params["vocab_size"] < min_vocab:
        raise ValueError(
            f"vocab_size {params['vocab_size']} is below {min_vocab}, the tokenizer's id range"
        )
    if "layer_types" not in (overrides or {}):
        params["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(params["num_hidden_layers"])
        ]
    params["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": float(params.pop("rope_theta")),
        "partial_rotary_factor": float(params.pop("partial_rotary_factor")),
    }
    params["eos_token_id"] = list(EOS_TOKEN_IDS)
    return params


def _tensor_seed(seed: int, name: str, block: int = 0) -> int:
    """One generator per tensor (and row block), keyed by its text name: values do not
    depend on naming (text or VLM), sharding, dtype, or the number of other layers."""
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _small_tensor(name: str, shape: tuple[int, ...], seed: int, device: str) -> torch.Tensor:
    """fp32 values of the 1-D parameters (norms, DeltaNet decay) and dummy biases."""
    gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))

    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    if name == "model.norm.weight":
        # (1 + w) ~ FINAL_NORM_GAIN * (1 + noise): scales logits, still off 0 and off 1.
        return FINAL_NORM_GAIN * (1 + NORM_NOISE_STD * randn()) - 1
    if name.endswith("linear_attn.norm.weight"):
        return 1 + NORM_NOISE_STD * randn()
    if name.startswith("model.visual.") and name.endswith(
        ("norm.weight", "norm1.weight", "norm2.weight")
    ):
        return 1 + NORM_NOISE_STD * randn()  # the tower's LayerNorms: plain gains around 1
    if name.endswith(("norm.weight", "norm.bias", "norm1.weight", "norm2.weight")):
        return NORM_NOISE_STD * randn()
    if name.endswith("A_log"):
        # Decay rates A from 0.05 (memory of ~100 tokens) to 16 (none), log-spread.
        u = torch.rand(shape, generator=gen, device=device, dtype=torch.float32)
        return math.log(0.05) + u * math.log(16.0 / 0.05) + 0.1 * randn()
    if name.endswith("dt_bias"):
        return randn() - 1.0
    return 0.02 * randn()  # biases of the dummy vision tower


def _weight_std(name: str, shape: tuple[int, ...], text: dict) -> float:
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return EMBED_NORM / math.sqrt(text["hidden_size"])
    return 1 / math.sqrt(math.prod(shape[1:]))  # fan-in; conv1d: the kernel width


def init_tensor(
    name: str,
    shape: tuple[int, ...],
    text: dict,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    pool: ThreadPoolExecutor | None = None,
) -> torch.Tensor:
    """The value of tensor `name` (its text-model HF name, or a visual tensor's or the MTP head's).

    Matrices are drawn in fp32 blocks of rows, each from its own generator, then rounded
    to `dtype`: memory stays at the output plus one block, and blocks run in `pool`.
    """
    if len(shape) < 2:
        return _small_tensor(name, shape, seed, device).to(dtype)
    std = _weight_std(name, shape, text)
    out = torch.empty(shape, dtype=dtype, device=device)
    rows_per_block = max(1, BLOCK_ELEMENTS // math.prod(shape[1:]))
    is_embedding = name.endswith(("embed_tokens.weight", "lm_head.weight"))
    first_padding_row = qwen_special_tokens()[-1][0] + 1

    def fill(block: int) -> None:
        start = block * rows_per_block
        rows = out[start : start + rows_per_block]
        gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name, block))
        values = torch.randn(rows.shape, generator=gen, device=device, dtype=torch.float32)
        values.mul_(std)
        if is_embedding and start + rows.shape[0] > first_padding_row:
            values[max(0, first_padding_row - start) :] *= PADDING_ROW_SCALE
        rows.copy_(values)

    blocks = range(math.ceil(shape[0] / rows_per_block))
    if pool is None:
        for block in blocks:
            fill(block)
    else:
        list(pool.map(fill, blocks))
    return out


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, fp32 weight_scale_inv) in blocks of block x block, as the FP8
    releases are made: each block's largest magnitude maps to FP8_MAX."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block, 0, -rows % block))
    # [row blocks, b, col blocks, b]
    blocks = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    values = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return values.flatten(2, 3).flatten(0, 1)[:rows, :cols].to(torch.float8_e4m3fn), scale_inv


def _meta_state_shapes(model_cls, config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = model_cls(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _tower(depth: int, hidden: int, inter: int, heads: int, positions: int = 2304) -> dict:
    return dict(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=inter,
        num_heads=heads,
        num_position_embeddings=positions,
        hidden_act="gelu_pytorch_tanh",
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        deepstack_visual_indexes=[],
    )


# The vision towers of the released checkpoints (vision_config; out_hidden_size is the text
# model's hidden size). 0.8B, 4B, 9B and 35B-A3B as their config.json say; 2B as the 4B's (Qwen's
# 2B-class towers, Qwen3-VL-2B's too, are the 24 x 1024 one). The tiny one for tests: 2 blocks.
VISION_PRESETS: dict[str, dict] = {
    "tiny": _tower(2, 32, 64, 2, positions=16),
    "0.8b": _tower(12, 768, 3072, 12),
    "2b": _tower(24, 1024, 4096, 16),
    "4b": _tower(24, 1024, 4096, 16),
    "9b": _tower(27, 1152, 4304, 16),
    "35b-a3b": _tower(27, 1152, 4304, 16),
}
VISION_PRESETS["tiny-moe"] = VISION_PRESETS["tiny"]


def _vision_config(text: dict, preset: str) -> dict:
    return dict(VISION_PRESETS[preset], out_hidden_size=text["hidden_size"])


# The processor settings of the released checkpoints (preprocessor_config.json and
# video_preprocessor_config.json): transformers' Qwen processors read them.
IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
}


MTP_HEADS = ("random", "agree")  # make_model's `mtp`: how the MTP head's values are drawn
# An "agree" checkpoint's target is mostly a bigram model: its lm_head is its embedding with
# the rows permuted (so the next token is mostly a function of this one) and its layers' output
# projections are scaled by this (so the context moves the choice now and then: measured on
# the tiny preset, 0.1 gave 94-100% acceptance, 0.2 29-50%, 0.03 100%).
AGREE_LAYER_SCALE = 0.18
AGREE_SCALED = re.compile(r"(o_proj|out_proj|down_proj)\.weight$")
# an "agree" head's fc passes the normed next-token embedding, at the embeddings' scale
AGREE_FC = "agree:fc"
AGREE_LM_HEAD = "agree:lm_head"
ZEROS = "zeros"


def mtp_entries(text: dict, shapes: dict[str, tuple[int, ...]], head: str) -> list[tuple]:
    """The released multi-token-prediction head `mtp.*` as (name, value name, shape): fc over
    [normed embedding | normed hidden], a full-attention decoder layer of the model's shape
    (its MLP or experts), a final norm. `head` "random" draws its own values; "agree" builds it
    from the target's own last full-attention layer and final norm, its fc passing the next
    token's normed embedding: with the target `agree_value` makes, its drafts often match the
    target's tokens, not always (tests)."""
    h = text["hidden_size"]
    last = max(i for i, kind in enumerate(text["layer_types"]) if kind == "full_attention")
    source = f"model.layers.{last}."
    copy = head == "agree"
    entries = [
        ("mtp.fc.weight", AGREE_FC if copy else "mtp.fc.weight", (h, 2 * h)),
        (
            "mtp.pre_fc_norm_embedding.weight",
            ZEROS if copy else "mtp.pre_fc_norm_embedding.weight",
            (h,),
        ),
        ("mtp.pre_fc_norm_hidden.weight", ZEROS if copy else "mtp.pre_fc_norm_hidden.weight", (h,)),
        ("mtp.norm.weight", "model.norm.weight" if copy else "mtp.norm.weight", (h,)),
    ]
    for name, shape in shapes.items():
        if name.startswith(source):
            part = name[len(source) :]
            entries.append(
                (f"mtp.layers.0.{part}", name if copy else f"mtp.layers.0.{part}", shape)
            )
    return entries


def agree_value(
    name: str, shape: tuple[int, ...], text: dict, seed: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    """A tensor of an "agree" checkpoint (`mtp_entries`): the head's own fc and pre-fc norms,
    the permuted lm_head, the layers' scaled output projections, else `init_tensor`'s."""
    if name == ZEROS:
        return torch.zeros(shape, dtype=dtype, device=device)
    if name == AGREE_FC:
        h = text["hidden_size"]
        fc = torch.zeros(shape, dtype=torch.float32, device=device)
        fc[:, :h] = torch.eye(h, device=device) * EMBED_NORM / math.sqrt(h)
        return fc.to(dtype)
    if name == AGREE_LM_HEAD:
        embedding = init_tensor("model.embed_tokens.weight", shape, text, seed, dtype, device)
        tokens = qwen_special_tokens()[0][0]  # the permutation keeps the special tokens' rows
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        order = torch.cat((torch.randperm(tokens, generator=gen), torch.arange(tokens, shape[0])))
        return embedding[order.to(device)]
    value = init_tensor(name, shape, text, seed, dtype, device)
    return value * AGREE_LAYER_SCALE if AGREE_SCALED.search(name) else value


def _experts_apart(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """HF's stacked expert tensors (`mlp.experts.gate_up_proj` [E, 2 I, H], `down_proj` [E, H, I])
    as the released checkpoints store them: `mlp.experts.E.{gate,up,down}_proj.weight`."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, (experts, rows, cols) = name.removesuffix("gate_up_proj"), shape
            out.update(
                {
                    f"{prefix}{e}.{m}.weight": (rows // 2, cols)
                    for e in range(experts)
                    for m in ("gate_proj", "up_proj")
                }
            )
        elif name.endswith("mlp.experts.down_proj"):
            prefix, (experts, rows, cols) = name.removesuffix("down_proj"), shape
            out.update({f"{prefix}{e}.down_proj.weight": (rows, cols) for e in range(experts)})
        else:
            out[name] = shape
    return out


def checkpoint_layout(
    text: dict, vlm_names: bool, mtp: str | None = None, vision_preset: str = "tiny"
) -> tuple[dict, list[tuple[str, str, tuple]]]:
    """(config.json contents, [(file name, value name, shape)]) in HF's state_dict order; an
    MoE model's experts one by one, as the releases store them (`_experts_apart`). The MTP
    head (`mtp_entries`) comes with `mtp`, and always in the VLM layout (random there unless
    `mtp` says otherwise), as in the releases."""
    text_config_cls, causal_lm, vlm_config, vlm = hf_classes(is_moe(text))
    text_config = text_config_cls(**text)
    shapes = _experts_apart(_meta_state_shapes(causal_lm, text_config))
    tied = text["tie_word_embeddings"]
    if tied:
        del shapes["lm_head.weight"]  # released tied checkpoints do not store it
    if mtp == "agree":
        shapes["lm_head.weight"] = shapes.pop("lm_head.weight")  # untied: the permuted rows
        names = {name: AGREE_LM_HEAD if name == "lm_head.weight" else name for name in shapes}
    else:
        names = {name: name for name in shapes}
    head = mtp_entries(text, shapes, mtp or "random") if mtp or vlm_names else []
    if not vlm_names:
        config = text_config.to_dict()
        config["architectures"] = [causal_lm.__name__]
        if head:
            config["mtp_num_hidden_layers"] = 1
        return config, [(n, names[n], s) for n, s in shapes.items()] + head

    full = vlm_config(
        text_config=text_config.to_dict(),
        vision_config=_vision_config(text, vision_preset),
        tie_word_embeddings=tied,
    )
    full_shapes = _experts_apart(_meta_state_shapes(vlm, full))
    entries = []
    for name, shape in shapes.items():
        vlm_name = re.sub(r"^model\.", "model.language_model.", name)
        if full_shapes.get(vlm_name) != shape:
            raise RuntimeError(f"{vlm_name}: not in {vlm.__name__} as {shape}")
        entries.append((vlm_name, names[name], shape))
    entries += [(n, n, s) for n, s in full_shapes.items() if n.startswith("model.visual.")]
    entries += head
    config = full.to_dict()
    config["architectures"] = [vlm.__name__]
    rotary_half = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]) // 2
    side = round(rotary_half * 11 / 32)
    config["text_config"]["rope_parameters"].update(
        mrope_section=[side, side, rotary_half - 2 * side], mrope_interleaved=True
    )
    config["text_config"]["mtp_num_hidden_layers"] = 1
    config["text_config"]["mtp_use_dedicated_embeddings"] = False
    return config, entries


def _plan_shards(
    entries: list[tuple[str, str, tuple]], itemsize: int, shard_bytes: int | None
) -> list[list[tuple[str, str, tuple]]]:
    """Split in order, as HF does: a new shard when the next tensor would pass the limit."""
    if shard_bytes is None:
        return [entries]
    shards: list[list] = [[]]
    used = 0
    for entry in entries:
        size = math.prod(entry[2]) * itemsize
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += size
    return shards


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    dtype: str = "fp32",
    seed: int = 0,
    vlm_names: bool = False,
    shard_size: str | int | None = None,
    overrides: dict | None = None,
    device: str = "cpu",
    fp8_block: int = 128,
    mtp: str | None = None,
) -> Path:
    """Write a random checkpoint of `preset` into `out_dir` (created) and return its path.

    Same seed, same values, whatever the naming, sharding or dtype (bf16 = fp32 rounded, fp8
    = fp32 quantized); values also depend on `device` (CPU and CUDA generators differ).
    `mtp` ("random", "agree"; `mtp_entries`): with the multi-token-prediction head, which the
    VLM layout always has.
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if mtp is not None and mtp not in MTP_HEADS:
        raise ValueError(f"mtp {mtp!r} is not one of {', '.join(MTP_HEADS)}")
    shard_bytes = None if shard_size is None else parse_size(shard_size)
    text = text_config_dict(preset, overrides)
    text["dtype"] = _DTYPE_NAMES[dtype]
    if mtp == "agree":  # its lm_head is not its embedding (agree_value)
        text["tie_word_embeddings"] = False
    config, entries = checkpoint_layout(text, vlm_names, mtp, preset)
    config["dtype"] = config["torch_dtype"] = _DTYPE_NAMES[dtype]
    config["eos_token_id"] = list(EOS_TOKEN_IDS)
    if dtype == "fp8":  # as Qwen's FP8 releases say it (transformers' FineGrainedFP8Config)
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [fp8_block, fp8_block],
            "modules_to_not_convert": FP8_NOT_CONVERTED,
        }

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = [
        *out.glob("model.safetensors"),
        *out.glob("model-*-of-*.safetensors"),
        *out.glob("model.safetensors.index.json"),
    ]
    for path in stale:  # never leave a mix of an old and a new checkpoint
        path.unlink()

    torch_dtype = DTYPES[dtype]
    shards = _plan_shards(entries, torch_dtype.itemsize, shard_bytes)
    weight_map: dict[str, str] = {}
    total_bytes = total_params = 0
    pool = ThreadPoolExecutor(torch.get_num_threads()) if device == "cpu" else None
    for i, shard in enumerate(shards):
        file_name = (
            "model.safetensors"
            if shard_bytes is None
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name, text_name, shape in shard:
            quantized = dtype == "fp8" and FP8_QUANTIZED.search(text_name)
            draw_dtype = torch.float32 if quantized else torch_dtype
            if mtp == "agree":
                value = agree_value(text_name, shape, text, seed, draw_dtype, device)
            else:
                value = init_tensor(text_name, shape, text, seed, draw_dtype, device, pool)
            if quantized:
                value, tensors[name + "_scale_inv"] = (
                    t.cpu() for t in quantize_fp8(value, fp8_block)
                )
                weight_map[name + "_scale_inv"] = file_name
            tensors[name] = value.cpu()
            weight_map[name] = file_name
            total_params += math.prod(shape)
            total_bytes += math.prod(shape) * value.dtype.itemsize
        save_file(tensors, out / file_name, metadata={"format": "pt"})
        (out / file_name).chmod(0o644)  # safetensors creates files owner-only
        del tensors
    if pool is not None:
        pool.shutdown()
    if shard_bytes is not None:
        index = {
            "metadata": {"total_size": total_bytes, "total_parameters": total_params},
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_json(out / "model.safetensors.index.json", index)

    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": list(EOS_TOKEN_IDS), "pad_token_id": PAD_TOKEN_ID},
    )
    write_tokenizer_files(out, model_max_length=text["max_position_embeddings"])
    if vlm_names:
        _write_json(out / "preprocessor_config.json", IMAGE_PROCESSOR)
        _write_json(out / "video_preprocessor_config.json", VIDEO_PROCESSOR)
    return out


def mean_top1_probability(
    model_dir: str | Path, num_prompts: int = 4, prompt_len: int = 80, seed: int = 0
) -> float:
    """Mean top-1 next-token probability of HF's model (fp32) over random-token prompts; on
    the GPU when there is one (with fla installed, HF's DeltaNet runs fla's Triton kernels,
    which need CUDA tensors)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = (
        hf_causal_lm(model_dir).from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    )
    gen = torch.Generator().manual_seed(seed)
    first_special = qwen_special_tokens()[0][0]
    ids = torch.randint(0, first_special, (num_prompts, prompt_len), generator=gen).to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    if not torch.isfinite(logits).all():
        raise RuntimeError(f"non-finite logits from {model_dir}")
    return logits.softmax(-1).amax(-1).mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.make_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", required=True, choices=list(PRESETS))
    parser.add_argument("--out", required=True, help="output folder (created)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument(
        "--fp8-block", type=int, default=128, help="with --dtype fp8: the scales' block side"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vlm-names",
        action="store_true",
        help="released VLM layout: model.language_model.* + visual/mtp tensors",
    )
    parser.add_argument("--shard-size", default=None, help="e.g. 50MB, 5GB: write shards + index")
    parser.add_argument(
        "--mtp",
        choices=MTP_HEADS,
        default=None,
        help="with the MTP head (speculative decoding): random, or built from the target's "
        "own last layers so that its drafts agree often (the VLM layout always has one)",
    )
    parser.add_argument("--device", default="cpu", help="where to draw values (cpu, cuda)")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="fewer (or more) layers than the preset's, every other shape kept",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="report HF's mean top-1 probability (default for tiny)",
    )
    args = parser.parse_args(argv)
    start_s = time.monotonic()
    out = make_model(
        args.out,
        preset=args.preset,
        dtype=args.dtype,
        seed=args.seed,
        vlm_names=args.vlm_names,
        shard_size=args.shard_size,
        device=args.device,
        fp8_block=args.fp8_block,
        mtp=args.mtp,
        overrides=None if args.layers is None else {"num_hidden_layers": args.layers},
    )
    size_gb = sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e9
    print(
        f"wrote {args.preset} ({args.dtype}) to {out}: {size_gb:.2f} GB of safetensors "
        f"in {time.monotonic() - start_s:.1f} s"
    )
    if args.measure or args.preset in ("tiny", "tiny-moe"):
        print(
            f"mean top-1 probability (HF, fp32, random prompts): {mean_top1_probability(out):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
