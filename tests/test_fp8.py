"""FP8 releases (block scales, as Qwen's -FP8 checkpoints): our model against transformers'
own FP8 loader, in every layout and at TP 2; malformed pairs and other quantizations refused
by name; `--quantization fp8` only for what is one; served end to end."""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from serve_helpers import ServeProcess, in_process_server
from test_tp_golden import run_tp
from transformers import Qwen3_5ForCausalLM

from deltaserve.engine.checkpoint_files import CheckpointError, check_same_tensors
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.model_config import ConfigError, ModelConfig
from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.http import serve
from deltaserve.http.server import ServerConfig
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.kernels.fp8_scales import dequantize
from deltaserve.tools.golden import compare_logprobs
from deltaserve.tools.make_model import FP8_MAX, FP8_QUANTIZED, make_model, quantize_fp8

BLOCK = 32  # the tiny model's widths are 64-512: several blocks each way
PROMPT = [random.Random(5).randrange(248044) for _ in range(90)]


def logits_of(model_dir) -> torch.Tensor:
    ex = Executor(ExecutorConfig(str(model_dir), max_num_seqs=1, num_kv_blocks=16))
    item = StepItem(1, 0, PROMPT, True, NewRequest(len(PROMPT), SamplingSpec(seed=0)))
    return ex.forward([item], every_position=True)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp("fp8") / "m", preset="tiny", dtype="fp8", fp8_block=BLOCK
    )


@pytest.fixture
def broken_copy(fp8_dir, tmp_path):
    return shutil.copytree(fp8_dir, tmp_path / "broken")


def test_fp8_release_matches_transformers(fp8_dir, tiny_model_dir):
    """Our logits equal those of transformers' FP8 loader (which widens the weights on a
    machine without FP8 kernels) to the golden bound, and are not the unquantized model's."""
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    fp8 = [name for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    # 3 DeltaNet layers: in_proj_qkv, z, out, the MLP's 3; 1 attention: q, k, v, o, MLP
    assert len(fp8) == 3 * 6 + 1 * 7
    hf = Qwen3_5ForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert torch.equal(
        dict(hf.named_parameters())[name],
        dequantize(tensors[name], tensors[name + "_scale_inv"], (BLOCK, BLOCK)),
    )
    with torch.inference_mode():
        reference = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = logits_of(fp8_dir)
    report = compare_logprobs(ours, reference)
    assert report.argmax_mismatches == 0 and report.max_abs_diff <= 1e-3, report
    # same seed, same values unrounded
    unquantized = compare_logprobs(logits_of(tiny_model_dir), reference)
    assert unquantized.mean_abs_diff > 10 * report.mean_abs_diff, (unquantized, report)


def compressed_tensors_copy(float_dir, out, strategy: str):
    """`float_dir`'s projections as llm-compressor writes FP8 (FP8_DYNAMIC's per-channel scales,
    one per tensor, or FP8_BLOCK's): float8 `weight` and its `weight_scale`, the rest bf16."""
    shutil.copytree(float_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if FP8_QUANTIZED.search(n)]:
        weight = tensors[name].float()
        if strategy == "block":
            values, scale = quantize_fp8(weight, BLOCK)
        else:
            scale = (
                weight.abs().amax(1, keepdim=True)
                if strategy == "channel"
                else weight.abs().amax().reshape(1)
            )
            scale = scale / FP8_MAX
            values = (
                (weight / (scale if strategy == "channel" else scale[0]))
                .clamp(-FP8_MAX, FP8_MAX)
                .to(torch.float8_e4m3fn)
            )
        tensors[name], tensors[name + "_scale"] = values, scale
    save_file(
        {
            n: t if t.dtype == torch.float8_e4m3fn or n.endswith("_scale") else t.to(torch.bfloat16)
            for n, t in tensors.items()
        },
        str(out / "model.safetensors"),
    )
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": strategy,
        "block_structure": [BLOCK, BLOCK] if strategy == "block" else None,
    }
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "output_activations": None,
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "dynamic": True,
                    "symmetric": True,
                    "strategy": "token",
                },
            }
        },
        "ignore": ["lm_head", "re:.*in_proj_a$", "re:.*in_proj_b$"],
        "kv_cache_scheme": None,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_compressed_tensors_fp8_matches_transformers(tiny_model_dir, tmp_path, strategy):
    """llm-compressor's FP8 checkpoints (vLLM's usual ones) against transformers' own
    compressed-tensors loader widening the same weights."""
    from transformers import CompressedTensorsConfig

    model_dir = compressed_tensors_copy(tiny_model_dir, tmp_path / strategy, strategy)
    hf = Qwen3_5ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([PROMPT])).logits[0].float()
    report = compare_logprobs(logits_of(model_dir), reference)
    assert report.argmax_mismatches == 0 and report.max_abs_diff <= 1e-3, report
    assert ModelConfig.from_model_dir(model_dir).fp8_scale_suffix == "_scale"


def test_vlm_layout_with_a_pair_split_across_shards_gives_the_same_logits(fp8_dir, tmp_path):
    """The released layout, sharded, and one weight's scales in another file than its values
    (a shard boundary may fall between them): the same model to the bit."""
    vlm = make_model(
        tmp_path / "vlm",
        preset="tiny",
        dtype="fp8",
        fp8_block=BLOCK,
        vlm_names=True,
        shard_size="1MB",
    )
    index_path = vlm / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    scale = "model.language_model.layers.2.mlp.down_proj.weight_scale_inv"
    source = vlm / index["weight_map"][scale]
    tensors = load_file(str(source))
    save_file({scale: tensors.pop(scale)}, str(vlm / "model-extra.safetensors"))
    save_file(tensors, str(source))
    index["weight_map"][scale] = "model-extra.safetensors"
    index_path.write_text(json.dumps(index))
    assert torch.equal(logits_of(vlm), logits_of(fp8_dir))


def test_kept_fp8_weights_give_the_widened_logits(fp8_dir):
    """Kept FP8 (as on CUDA), every projection whose parts are all FP8 holds FP8 values and
    their block scales; the DeltaNet's in_proj, whose b and a parts are bf16, is widened. On the
    CPU a kept weight is widened at each product, so the logits are the widened model's, bit
    for bit."""
    ex = Executor(
        ExecutorConfig(str(fp8_dir), max_num_seqs=1, num_kv_blocks=16, fp8_weights="keep")
    )
    dtypes = {
        name: p.dtype for name, p in ex.model.named_parameters() if name.startswith("model.layers.")
    }
    kept = {
        name.removesuffix(".weight")
        for name, dtype in dtypes.items()
        if dtype == torch.float8_e4m3fn
    }
    assert {name.split(".", 3)[3] for name in kept} == {
        "linear_attn.out_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
        "self_attn.qkv_proj",
        "self_attn.o_proj",
    }
    assert all(dtypes[f"{name}.weight_scale_inv"] == torch.float32 for name in kept)
    assert dtypes["model.layers.0.linear_attn.in_proj.weight"] == torch.float32
    item = StepItem(1, 0, PROMPT, True, NewRequest(len(PROMPT), SamplingSpec(seed=0)))
    assert torch.equal(ex.forward([item], every_position=True), logits_of(fp8_dir))


@pytest.mark.parametrize("fp8_weights", ["widen", "keep"])
def test_tp2_matches_tp1(fp8_dir, tmp_path, fp8_weights):
    """Each rank takes its shard of the widened weight, or of the FP8 values and their block
    scales: TP 2 over gloo gives TP 1's greedy tokens and logits."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prompt = PROMPT[:70]
    tp1 = run_tp(1, fp8_dir, tmp_path, prompt)
    tp2 = run_tp(2, fp8_dir, tmp_path, prompt, fp8_weights=fp8_weights)
    assert tp2["tokens"] == tp1["tokens"]
    report = compare_logprobs(tp2["prefill"], tp1["prefill"])
    assert report.argmax_mismatches == 0 and report.max_abs_diff <= 1e-4, report


def test_fp8_only_where_the_shards_are_whole_blocks():
    """A projection whose rank shards would cut a block stays widened (`keep_fp8` says no)."""
    from deltaserve.engine.rank.linear import ColumnParallelLinear, RowParallelLinear

    column = ColumnParallelLinear(64, ((64, 64, 128),), torch.float32, torch.device("cpu"))
    assert not column.keep_fp8((48, 48)) and column.weight.dtype == torch.float32
    assert column.keep_fp8((32, 48)) and column.weight_scale_inv.shape == (8, 2)
    row = RowParallelLinear(100, 64, torch.float32, torch.device("cpu"))
    assert not row.keep_fp8((32, 32)) and row.weight_scale_inv is None


def test_dequantize_partial_blocks():
    """Blocks at the right and bottom edges may be
    partial: each value takes its own block's scale."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 45, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=gen) + 0.5
    got = dequantize(weight, scale, (32, 32))
    for i, j in [(0, 0), (31, 31), (32, 0), (69, 44), (40, 33), (64, 12)]:
        assert got[i, j] == weight[i, j].float() * scale[i // 32, j // 32], (i, j)
    with pytest.raises(ValueError, match=r"scales have shape \[2, 2\], not \[3, 2\]"):
        dequantize(weight, scale[:2], (32, 32))


def edit_tensors(model_dir, edit) -> None:
    path = str(model_dir / "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


DOWN = "model.layers.1.mlp.down_proj.weight"
TENSOR_FAULTS = {
    "no scales": (
        lambda t: t.pop(DOWN + "_scale_inv"),
        rf"unpaired FP8 tensors: {DOWN} \(FP8, no _scale_inv\)",
    ),
    "scales of a plain weight": (
        lambda t: t.__setitem__(DOWN, t[DOWN].to(torch.bfloat16)),
        rf"unpaired FP8 tensors: {DOWN}_scale_inv \(no FP8 weight\)",
    ),
    "scales of the wrong grid": (
        lambda t: t.__setitem__(DOWN + "_scale_inv", t[DOWN + "_scale_inv"][:, :1].clone()),
        rf"FP8 weight {DOWN}: its scales have shape \[2, 1\], "
        r"not \[2, 4\] \(weight \[64, 128\] in blocks of \[32, 32\]\)",
    ),
    "integer scales": (
        lambda t: t.__setitem__(DOWN + "_scale_inv", t[DOWN + "_scale_inv"].to(torch.int32)),
        rf"{DOWN}_scale_inv has dtype int32, not fp32 scales \(in model.safetensors\)",
    ),
}


@pytest.mark.parametrize("fault", TENSOR_FAULTS)
def test_malformed_pairs_are_named(broken_copy, fault):
    edit, error = TENSOR_FAULTS[fault]
    edit_tensors(broken_copy, edit)
    with pytest.raises(CheckpointError, match=error):
        logits_of(broken_copy)


CONFIG_FAULTS = {
    "awq": (
        {"quant_method": "awq", "bits": 4},
        r"other than FP8 are not supported \(quantization_config: 'awq'\)",
    ),
    "static": ({"activation_scheme": "static"}, r"activation_scheme 'static' is not supported"),
    "per tensor": (
        {"weight_block_size": None},
        r"one scale per tensor \(no weight_block_size\) is not supported",
    ),
    "bad block": (
        {"weight_block_size": [128]},
        r"weight_block_size is \[128\], not \[rows, columns\]",
    ),
    "zero block": (
        {"weight_block_size": [0, 128]},
        r"weight_block_size is \[0, 128\], not two positive integers",
    ),
}


GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
CONFIG_FAULTS |= {
    "w4a16": (
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "g": {**GROUP, "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}
            },
        },
        r"config_groups.g: 4-bit int weights \(pack-quantized\) are not supported, only FP8",
    ),
    "static inputs": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "g": {
                    **GROUP,
                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": False},
                }
            },
        },
        r"config_groups.g: static activation scales are not supported",
    ),
    "kv cache": (
        {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}},
        r"kv_cache_scheme \(a quantized KV cache\) is not supported",
    ),
    "two strategies": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "a": GROUP,
                "b": {**GROUP, "weights": {**GROUP["weights"], "strategy": "tensor"}},
            },
        },
        r"config groups of different weight strategies are not supported",
    ),
}


@pytest.mark.parametrize("fault", CONFIG_FAULTS)
def test_other_quantizations_are_refused_by_name(broken_copy, fault):
    change, error = CONFIG_FAULTS[fault]
    path = broken_copy / "config.json"
    config = json.loads(path.read_text())
    quant = config["quantization_config"] = (
        change if "quant_method" in change else {**config["quantization_config"], **change}
    )
    if quant.get("weight_block_size", 0) is None:
        del quant["weight_block_size"]
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=error):
        ModelConfig.from_model_dir(broken_copy)


@pytest.mark.parametrize("fp8_weights", ["widen", "keep"])
def test_new_fp8_weights_in_place(fp8_dir, tmp_path, fp8_weights):
    """A weight update (`Executor.load_weights`, as a rank runs it) from another FP8 checkpoint
    gives the logits of an executor started on it, widened or kept."""
    other = make_model(tmp_path / "other", preset="tiny", dtype="fp8", fp8_block=BLOCK, seed=1)
    item = StepItem(1, 0, PROMPT, True, NewRequest(len(PROMPT), SamplingSpec(seed=0)))

    def executor(model_dir):
        return Executor(
            ExecutorConfig(
                str(model_dir), max_num_seqs=1, num_kv_blocks=16, fp8_weights=fp8_weights
            )
        )

    updated, fresh = executor(fp8_dir), executor(other)
    before = updated.forward([item], every_position=True)
    updated.drop([1])
    updated.load_weights(str(other))
    after = updated.forward([item], every_position=True)
    assert torch.equal(after, fresh.forward([item], every_position=True))
    assert not torch.equal(after, before)


def test_weight_update_checks(fp8_dir, tiny_model_dir, tmp_path):
    """Another FP8 checkpoint of the model passes the update's header check; an unquantized
    one is another config (its quantization), and an FP8 tensor where the served one is plain is
    refused."""
    config = ModelConfig.from_model_dir(fp8_dir)
    other = make_model(tmp_path / "other", preset="tiny", dtype="fp8", fp8_block=BLOCK, seed=1)
    check_same_tensors(fp8_dir, other, config)
    assert config.differences(ModelConfig.from_model_dir(tiny_model_dir)) == ["fp8_block"]
    edit_tensors(
        other,
        lambda t: t.__setitem__(
            "model.norm.weight", t["model.norm.weight"].to(torch.float8_e4m3fn)
        ),
    )
    with pytest.raises(CheckpointError, match="model.norm.weight of dtype float8_e4m3fn"):
        check_same_tensors(fp8_dir, other, config)


def test_quantization_flag_only_for_an_fp8_release(fp8_dir, tiny_model_dir, capsys):
    """vLLM's --quantization fp8 quantizes an unquantized checkpoint as it loads; here that is
    refused before anything starts, and an FP8 release passes the check (then the port fails)."""
    assert serve.serve_main([str(tiny_model_dir), "--quantization", "fp8"]) == 2
    assert (
        f"--quantization fp8: {tiny_model_dir} is not an FP8 checkpoint" in capsys.readouterr().err
    )
    assert serve.serve_main([str(fp8_dir), "--quantization", "compressed-tensors"]) == 2
    assert (
        f"--quantization compressed-tensors: {fp8_dir}'s quantization_config says fp8"
        in capsys.readouterr().err
    )
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert serve.serve_main([str(fp8_dir), "--quantization", "fp8", "--port", str(port)]) == 1


def greedy_tokens(model_dir, ids: list[int], steps: int) -> list[str]:
    """Our executor's greedy tokens, as `return_tokens_as_token_ids` names them."""
    ex = Executor(ExecutorConfig(str(model_dir), max_num_seqs=1, num_kv_blocks=16))
    tokens: list[int] = []
    logits = ex.forward(
        [StepItem(1, 0, ids, True, NewRequest(len(ids) + steps, SamplingSpec(seed=0)))]
    )
    for step in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = ex.forward([StepItem(1, len(ids) + step, [tokens[-1]], True)])
    return [f"token_id:{token}" for token in tokens]


async def served_tokens(url: str, model: str, ids: list[int], steps: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
    out = await client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=steps,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    return out.choices[0].logprobs.tokens


async def test_served_through_the_openai_client(fp8_dir):
    """The FP8 release behind the OpenAI endpoint answers as our model does on its own."""
    config = EngineConfig(model=str(fp8_dir), device="cpu", max_num_seqs=2, num_kv_blocks=64)
    async with in_process_server(config, ServerConfig("fp8")) as s:
        assert await served_tokens(s.url, "fp8", PROMPT[:20], 8) == greedy_tokens(
            fp8_dir, PROMPT[:20], 8
        )


async def test_served_with_fp8_weights_kept(fp8_dir):
    """`deltaserve serve --fp8-weights keep`: every rank holds the all-FP8 projections as FP8
    (13 in the tiny model: its 4 MLPs' 2, 3 out_proj, 1 attention's qkv and o_proj) and answers
    as the widened model does (bit for bit on the CPU, where each product widens them)."""
    server = await ServeProcess.start(str(fp8_dir), "--fp8-weights", "keep")
    try:
        assert re.search(
            r"rank 0: weights loaded in [\d.]+ s; 13 projections kept FP8", server.log(80)
        ), server.log()
        assert await served_tokens(server.url, str(fp8_dir), PROMPT[:20], 8) == greedy_tokens(
            fp8_dir, PROMPT[:20], 8
        )
    finally:
        await server.kill()
