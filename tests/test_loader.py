"""Checkpoint loading: both naming schemes and sharding give the same model; broken folders
are refused with an error that names the tensor or the setting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.engine.rank.executor import Executor, ExecutorConfig
from deltaserve.engine.rank.loader import CheckpointError
from deltaserve.ipc.messages import NewRequest, SamplingSpec, StepItem
from deltaserve.tools.make_model import make_model

PROMPT = [(i * 7919) % 248044 for i in range(70)]


def logits_of(model_dir) -> torch.Tensor:
    ex = Executor(ExecutorConfig(str(model_dir), num_slots=1, num_blocks=8))
    item = StepItem(1, 0, PROMPT, True, NewRequest(len(PROMPT), SamplingSpec(seed=0)))
    return ex.forward([item], every_position=True)


def test_naming_schemes_and_shards_give_the_same_logits(tiny_model_dir, tmp_path):
    text = logits_of(tiny_model_dir)
    vlm = make_model(tmp_path / "vlm", preset="tiny", dtype="fp32", seed=0, vlm_names=True)
    sharded = make_model(tmp_path / "sharded", preset="tiny", dtype="fp32", seed=0, shard_size="20MB")
    assert json.loads((vlm / "config.json").read_text())["model_type"] == "qwen3_5"
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert torch.equal(logits_of(vlm), text)
    assert torch.equal(logits_of(sharded), text)


@pytest.fixture
def broken_copy(tiny_model_dir, tmp_path):
    target = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, target)
    return target


def test_wrong_model_type_is_refused(broken_copy):
    path = broken_copy / "config.json"
    config = json.loads(path.read_text())
    config["model_type"] = "llama"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        logits_of(broken_copy)


def rewrite_tensors(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_is_named(broken_copy):
    name = "model.layers.1.linear_attn.A_log"
    rewrite_tensors(broken_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="lacks tensors: model.layers.1.linear_attn.A_log"):
        logits_of(broken_copy)


def test_wrong_shape_is_named_with_its_file(broken_copy):
    name = "model.layers.3.self_attn.k_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1].clone()

    rewrite_tensors(broken_copy, shrink)
    with pytest.raises(CheckpointError, match=rf"{name}.*model.safetensors.*shape"):
        logits_of(broken_copy)


def test_unexpected_text_tensor_is_named(broken_copy):
    def add(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    rewrite_tensors(broken_copy, add)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra_proj.weight'"):
        logits_of(broken_copy)
