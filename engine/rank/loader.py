"""Load an HF Qwen3.5 checkpoint folder into our model, one rank's shard at a time.

Accepts both naming schemes: `model.language_model.*` of the released vision-language
checkpoints (whose `model.visual.*` and `mtp.*` tensors are skipped) and `model.*` of text-only
saves; single or sharded safetensors (`model.safetensors.index.json`); tied embeddings (no
`lm_head.weight`, or one we ignore). A missing tensor, a wrong shape or an unexpected text
tensor is an error that names the tensor and the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
VLM_TEXT_PREFIX = "model.language_model."


class CheckpointError(ValueError):
    pass


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (model_dir / name).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return [model_dir / name for name in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {model_dir}")
    return files


def text_name(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor name; None for tensors we skip."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith(VLM_TEXT_PREFIX):
        return "model." + name[len(VLM_TEXT_PREFIX) :]
    return name


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, Path, Callable[[], torch.Tensor]]]:
    """(checkpoint name, file, loader of the tensor) for every tensor of the folder."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, path, (lambda f=f, name=name: f.get_tensor(name))


def load_weights(model: nn.Module, model_dir: str | Path, tie_word_embeddings: bool) -> None:
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, path, read in iter_tensors(model_dir):
        target = text_name(name)
        if target is None:
            continue
        if target == "lm_head.weight" and tie_word_embeddings:
            continue  # tied: the embedding serves as lm_head
        param = params.get(target)
        if param is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {path.name}")
        try:
            param.weight_loader(param, read())
        except ValueError as e:
            raise CheckpointError(f"tensor {name!r} in {path.name}: {e}") from None
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {model_dir} lacks tensors: {shown}")
