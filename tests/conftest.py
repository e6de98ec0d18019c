"""Shared fixtures: random Qwen3.5 checkpoints in the real format, made once per session."""

from __future__ import annotations

import importlib
import os
import zlib
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter (tests/test_kernels.py); the
# switch must be set before Triton is first imported. The model's CPU path never uses Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deltaserve.tools.make_model import make_model


@pytest.fixture(autouse=True)
def _seeded_torch(request: pytest.FixtureRequest) -> None:
    """Each test draws the same random inputs on every run, whatever ran before it: a bf16
    kernel's error against its reference varies by draw (tests/test_moe.py's experts: 0.7-1.8%
    over 20 draws), and an unseeded one once crossed its bound in CI."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="module")
def kernels() -> dict:
    """The kernel modules: compiled for the GPU, or run by Triton's interpreter on the CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed and there is no GPU")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # triton reads the flag when it is first imported, before any test runs
        pytest.skip("no GPU: set TRITON_INTERPRET=1 for the whole session to use the interpreter")
    names = [
        "gated_delta",
        "causal_conv1d",
        "paged_attention",
        "rmsnorm",
        "rope",
        "activation",
        "skinny_linear",
        "embedding",
    ]
    return {n: importlib.import_module(f"deltaserve.kernels.{n}") for n in names}


@pytest.fixture(scope="module")
def device() -> torch.device:
    """Where the kernel tests run their kernels: CUDA, else the CPU (the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny preset, fp32, seed 0, text names (`model.*`), one safetensors file."""
    return make_model(tmp_path_factory.mktemp("tiny"), preset="tiny", dtype="fp32", seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same weights as `tiny_model_dir` in the released layout: `model.language_model.*`
    plus `model.visual.*` and `mtp.*` tensors to skip, in 2 shards with an index file."""
    return make_model(
        tmp_path_factory.mktemp("tiny_vlm"),
        preset="tiny",
        dtype="fp32",
        seed=0,
        vlm_names=True,
        shard_size="20MB",
    )


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny mixture-of-experts preset (8 experts, 2 a token, a shared one), fp32, seed 0,
    its experts stored one by one as the releases store them."""
    return make_model(tmp_path_factory.mktemp("tiny_moe"), preset="tiny-moe", dtype="fp32", seed=0)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="run the load / fault suite at its long size (GPU or soak run), not the CI size",
    )
