"""Load an HF Qwen3.5 checkpoint folder into our model, one rank's shard at a time.

Accepts both naming schemes: `model.language_model.*` of the released vision-language
checkpoints (whose `model.visual.*` tensors are skipped, and `mtp.*` unless the model has an
MTP head, engine/rank/mtp.py) and `model.*` of text-only saves; single or sharded safetensors
(`model.safetensors.index.json`); tied embeddings (no
`lm_head.weight`, or one we ignore); FP8 checkpoints (fp8.py), each FP8 weight widened with
its scales as it loads, or, asked to (`keep_fp8`), loaded as it is into a projection that
stays FP8 (linear.py). A missing tensor (named as the checkpoint's layout names it), a wrong
shape, a dtype that is not a float one (integer, bool, or FP8 outside an FP8 checkpoint) or an
unexpected text tensor is an error that names the tensor and the file. Floating tensors (fp32,
bf16, fp16, fp64) are converted to the model's dtype.

Projections the model runs as one GEMM (`model.packed_modules`: checkpoint module name ->
(our module name, part)) load tensor by tensor into their part of the merged weight.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from deltaserve.engine.checkpoint_files import (
    FLOAT_DTYPES,
    VLM_TEXT_PREFIX,
    CheckpointError,
    SafetensorsError,
    checkpoint_files,
    is_mtp,
    read_header,
    text_name,
)
from deltaserve.engine.model_config import FP8_SCALE_SUFFIXES, ModelConfig
from deltaserve.engine.rank.checkpoint_reader import CheckpointReader
from deltaserve.engine.rank.fp8 import Fp8Pairs
from deltaserve.kernels.fp8_scales import FP8_DTYPES

# one expert's projection as released checkpoints store it -> (our stacked parameter, part)
EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def checkpoint_name(target: str, vlm_layout: bool) -> str:
    """The name a text name has in a checkpoint of the given layout (inverse of text_name)."""
    if vlm_layout and target.startswith("model."):
        return VLM_TEXT_PREFIX + target[len("model.") :]
    return target


def packed_target(name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """(our parameter name, part) of a checkpoint text name: `...mlp.up_proj.weight` ->
    (`...mlp.gate_up_proj.weight`, 1) when up_proj is packed; else (name, 0)."""
    parts = name.split(".")
    for i, module in enumerate(parts):
        if module in packed:
            merged, part = packed[module]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), part
    return name, 0


def expert_names(param_name: str, num_experts: int) -> set[str]:
    """The released per-expert names a stacked expert
    parameter (`...mlp.experts.down_proj`) holds."""
    prefix, stacked = param_name.rsplit(".", 1)
    modules = [module for module, (target, _) in EXPERT_PARTS.items() if target == stacked]
    return {
        f"{prefix}.{expert}.{module}.weight" for expert in range(num_experts) for module in modules
    }


def expected_names(params: dict[str, nn.Parameter], packed: dict[str, tuple[str, int]]) -> set[str]:
    """The checkpoint text names that must be present: each packed parameter once per part,
    each stacked expert parameter once per expert and part (or the stacked tensor)."""
    modules_of: dict[str, list[str]] = {}
    for module, (merged, _) in packed.items():
        modules_of.setdefault(merged, []).append(module)
    names = set()
    for name, param in params.items():
        if hasattr(param, "num_experts"):
            names |= expert_names(name, param.num_experts)
            continue
        parts = name.split(".")
        at = next((i for i, module in enumerate(parts) if module in modules_of), None)
        if at is None:
            names.add(name)
            continue
        for module in modules_of[parts[at]]:
            names.add(".".join([*parts[:at], module, *parts[at + 1 :]]))
    return names


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    config: ModelConfig,
    keep_fp8: bool = False,
    confined: bool = False,
) -> int:
    """keep_fp8: an FP8 checkpoint's projections stay FP8 where they can (`keep_fp8_modules`);
    else every FP8 weight is widened. `confined`: new weights (checkpoint_files), in which
    the MTP head's tensors are optional (a trainer's save drops them: the head keeps its
    weights). The `mtp.*` tensors load only into a model with an MTP head. Returns how
    many projections hold FP8."""
    model_dir = Path(model_dir)
    tie_word_embeddings = config.tie_word_embeddings
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules", {})
    # the kernels' tiles need row blocks, and the kept scales are Qwen's `weight_scale_inv`
    if (
        keep_fp8
        and config.fp8_block
        and min(config.fp8_block) > 1
        and config.fp8_scale_suffix == FP8_SCALE_SUFFIXES["fp8"]
    ):
        keep_fp8_modules(model, model_dir, packed, config.fp8_block, confined)
    params = dict(model.named_parameters())
    kept = sum(param.dtype in FP8_DTYPES for param in params.values())
    device = next(iter(params.values())).device
    has_mtp = any(is_mtp(name) for name in params)

    vlm_layout = False  # any `model.language_model.*` name: missing tensors are named so too

    def wanted(name: str) -> bool:  # called for every name in each file's header
        nonlocal vlm_layout
        vlm_layout = vlm_layout or name.startswith(VLM_TEXT_PREFIX)
        target = text_name(name)
        return (
            target is not None
            and (has_mtp or not is_mtp(target))
            and not (
                target.removesuffix(config.fp8_scale_suffix) == "lm_head.weight"
                and tie_word_embeddings
            )
        )

    reader = CheckpointReader(device)
    fp8 = Fp8Pairs(config.fp8_block, config.fp8_scale_suffix) if config.fp8_block else None
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir, confined):
        try:
            for name, tensor in reader.tensors(path, wanted):
                if fp8 is not None and not holds_fp8(params, packed, name.removesuffix(fp8.suffix)):
                    if (taken := fp8_take(fp8, name, path, tensor)) is None:
                        continue  # half of an FP8 pair: the other half comes later
                    name, tensor = taken
                load_tensor(params, packed, name, path, tensor, loaded)
        except SafetensorsError as e:
            raise CheckpointError(f"{model_dir}: {e}") from None
    if fp8 is not None and (unpaired := fp8.unpaired()):
        raise CheckpointError(
            f"checkpoint {model_dir} has unpaired FP8 tensors: {', '.join(unpaired[:5])}"
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the staging copies' blocks, which later allocations would pin
    missing = sorted(
        checkpoint_name(name, vlm_layout)
        for name in expected_names(params, packed) - loaded
        if not (confined and is_mtp(name))
    )
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(f"checkpoint {model_dir} lacks tensors: {shown}")
    return kept


def keep_fp8_modules(
    model: nn.Module,
    model_dir: Path,
    packed: dict[str, tuple[str, int]],
    block: tuple[int, int],
    confined: bool = False,
) -> None:
    """Before any tensor loads: each projection whose checkpoint tensors (every part of a packed
    one) are all float8_e4m3fn holds its weight as FP8, where its shards allow (`keep_fp8`)."""
    dtypes = {}
    try:
        for path in checkpoint_files(model_dir, confined):
            dtypes.update((text_name(entry.name), entry.dtype) for entry in read_header(path))
    except SafetensorsError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    for name, module in model.named_modules():
        if (
            not hasattr(module, "keep_fp8") or module.weight.dtype in FP8_DTYPES
        ):  # kept already (an update)
            continue
        sources = expected_names({f"{name}.weight": module.weight}, packed)
        if all(dtypes.get(source) == torch.float8_e4m3fn for source in sources):
            module.keep_fp8(block)


def holds_fp8(
    params: dict[str, nn.Parameter], packed: dict[str, tuple[str, int]], weight: str
) -> bool:
    """Whether a checkpoint weight (and so its scales) goes as it is into a kept FP8 projection."""
    param = params.get(packed_target(text_name(weight) or "", packed)[0])
    return param is not None and param.dtype in FP8_DTYPES


def fp8_take(
    fp8: Fp8Pairs, name: str, path: Path, tensor: torch.Tensor
) -> tuple[str, torch.Tensor] | None:
    try:
        return fp8.take(name, tensor)
    except ValueError as e:
        raise CheckpointError(f"{e} (in {path.name})") from None


def load_tensor(
    params: dict[str, nn.Parameter],
    packed: dict[str, tuple[str, int]],
    name: str,
    path: Path,
    tensor: torch.Tensor,
    loaded: set[str],
) -> None:
    """Copy one checkpoint tensor into its parameter (or its part of a packed one)."""
    target = text_name(name)
    assert target is not None  # the reader hands out wanted names only
    if expert := EXPERT_TENSOR.match(target):
        merged, part = EXPERT_PARTS[expert[3]]
        param_name = f"{expert[1]}.{merged}"
    else:
        param_name, part = packed_target(target, packed)
    param = params.get(param_name)
    stacked = hasattr(param, "num_experts")
    if param is None or (expert and not stacked):
        raise CheckpointError(f"unexpected tensor {name!r} in {path.name}")
    args, covers = (), {target}  # the loader's arguments past (param, tensor); the names it loads
    if expert:
        args = (int(expert[2]), part)
    elif stacked:  # a stacked tensor holds every expert's
        covers = expert_names(param_name, param.num_experts)
    elif hasattr(param, "num_parts"):  # a ColumnParallelLinear: into its part
        args = (part,)
    if covers & loaded:
        raise CheckpointError(f"tensor {name!r} in {path.name} appears twice in the checkpoint")
    if param.dtype in FP8_DTYPES and tensor.dtype != param.dtype:  # a copy would quantize it anew
        raise CheckpointError(
            f"tensor {name!r} in {path.name} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
            f"not the served FP8 weight's {str(param.dtype).removeprefix('torch.')}"
        )
    if (
        tensor.dtype not in FLOAT_DTYPES and param.dtype not in FP8_DTYPES
    ):  # checked before the copy, which would convert it
        dtype = str(tensor.dtype).removeprefix("torch.")
        what = (
            "FP8-quantized weights"
            if tensor.dtype.is_floating_point
            else f"{dtype} values, not weights"
        )
        raise CheckpointError(
            f"tensor {name!r} in {path.name} has dtype {dtype} ({what}; a quantized checkpoint "
            "without its quantization_config?): only floating-point tensors (fp32, bf16, fp16, "
            "fp64) load"
        )
    try:
        param.weight_loader(param, tensor, *args)
    except (ValueError, IndexError) as e:
        raise CheckpointError(f"tensor {name!r} in {path.name}: {e}") from None
    loaded |= covers
