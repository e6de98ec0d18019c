"""Shared fixtures: random Qwen3.5 checkpoints in the real format, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.tools.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny preset, fp32, seed 0, text names (`model.*`), one safetensors file."""
    return make_model(tmp_path_factory.mktemp("tiny"), preset="tiny", dtype="fp32", seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same weights as `tiny_model_dir` in the released layout: `model.language_model.*`
    plus `model.visual.*` and `mtp.*` tensors to skip, in 2 shards with an index file."""
    return make_model(tmp_path_factory.mktemp("tiny_vlm"), preset="tiny", dtype="fp32", seed=0,
                      vlm_names=True, shard_size="20MB")
