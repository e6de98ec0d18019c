"""Load an HF Qwen3.5 checkpoint folder into our model, one rank's shard at a time.

Accepts both naming schemes: `model.language_model.*` of the released vision-language
checkpoints (whose `model.visual.*` and `mtp.*` tensors are skipped) and `model.*` of text-only
saves; single or sharded safetensors (`model.safetensors.index.json`); tied embeddings (no
`lm_head.weight`, or one we ignore). A missing tensor, a wrong shape or an unexpected text
tensor is an error that names the tensor and the file.

Projections the model runs as one GEMM (`model.packed_modules`: checkpoint module name ->
(our module name, part)) load tensor by tensor into their part of the merged weight.
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


def packed_target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """(our parameter name, part) of a checkpoint text name: `...mlp.up_proj.weight` ->
    (`...mlp.gate_up_proj.weight`, 1) when up_proj is packed; else (name, 0)."""
    parts = name.split(".")
    for i, module in enumerate(parts):
        if module in packed:
            merged, part = packed[module]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), part
    return name, 0


def expected_names(params: dict[str, nn.Parameter], packed: dict[str, tuple[str, int]]) -> set[str]:
    """The checkpoint text names that must be present: each packed parameter once per part."""
    modules_of: dict[str, list[str]] = {}
    for module, (merged, _) in packed.items():
        modules_of.setdefault(merged, []).append(module)
    names = set()
    for name in params:
        parts = name.split(".")
        at = next((i for i, module in enumerate(parts) if module in modules_of), None)
        if at is None:
            names.add(name)
            continue
        for module in modules_of[parts[at]]:
            names.add(".".join([*parts[:at], module, *parts[at + 1 :]]))
    return names


def load_weights(model: nn.Module, model_dir: str | Path, tie_word_embeddings: bool) -> None:
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for name, path, read in iter_tensors(model_dir):
        target = text_name(name)
        if target is None:
            continue
        if target == "lm_head.weight" and tie_word_embeddings:
            continue  # tied: the embedding serves as lm_head
        param_name, part = packed_target(target, packed)
        param = params.get(param_name)
        if param is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {path.name}")
        if target in loaded:
            raise CheckpointError(f"tensor {name!r} in {path.name} appears twice in the checkpoint")
        try:
            if hasattr(param, "num_parts"):  # a ColumnParallelLinear: load into its part
                param.weight_loader(param, read(), part)
            else:
                param.weight_loader(param, read())
        except ValueError as e:
            raise CheckpointError(f"tensor {name!r} in {path.name}: {e}") from None
        loaded.add(target)
    missing = sorted(expected_names(params, packed) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {model_dir} lacks tensors: {shown}")
