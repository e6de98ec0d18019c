"""A checkpoint folder before any tensor's bytes are read: its safetensors files (the
shard-path rules), their headers (each tensor's name, dtype, shape and place in its file), our
names for the text model's tensors, and the check a weight update makes of a new folder.

A leaf (it imports nothing of ours but other leaves): the engine checks a weight update with
it before any rank copies a tensor (a rank failing half-way poisons the replica); the ranks'
loader and reader (engine/rank/loader.py, checkpoint_reader.py) read through it. It imports
torch, which serving never needs else: the engine imports it in a worker thread, at an update.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deltaserve.engine.model_config import ModelConfig

SKIPPED_PREFIXES = ("model.visual.",)
VLM_TEXT_PREFIX = "model.language_model."
# the multi-token-prediction head (engine/rank/mtp.py): loaded only into a model that has one
MTP_PREFIXES = ("mtp.", "model.mtp.")
DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# dtypes we convert to the model's; any other (integers, bool, FP8) is a quantized or foreign
# tensor whose values a plain conversion would turn into garbage weights
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offsets into the file, header included
    end: int


# what a safetensors error may say of a file: its messages can quote the file's bytes (a bad
# dtype's or shape's JSON value), so only these fixed phrases of theirs are repeated
_LIBRARY_FAULTS = (
    "header too large",
    "header too small",
    "invalid JSON in header",
    "invalid offset",
    "incomplete metadata",
    "invalid shape, data type, or offset",
)


def read_header(path: Path) -> list[TensorEntry]:
    """The file's tensors in file order, as the safetensors library reads and validates its
    header (a JSON object of dtype, shape and data offsets; the offsets contiguous from the
    data's start and covering the file to its end, else it refuses the file). The data
    starts where the tensors' sizes, counted back from the file's end, say. An error names
    the file and what is wrong, never a byte of the file."""
    try:
        with safe_open(path, framework="pt") as f:
            specs = [(name, f.get_slice(name)) for name in f.offset_keys()]
            specs = [(name, spec.get_dtype(), tuple(spec.get_shape())) for name, spec in specs]
    except SafetensorError as e:
        fault = next((phrase for phrase in _LIBRARY_FAULTS if phrase in str(e)), "unreadable")
        raise SafetensorsError(f"{path.name}: not a safetensors file ({fault})") from None
    dtypes = []
    for name, dtype_name, _ in specs:
        if dtype_name not in DTYPES:
            raise SafetensorsError(
                f"{path.name}: tensor {name!r} has unsupported dtype {dtype_name!r}"
            )
        dtypes.append(DTYPES[dtype_name])
    sizes = [
        math.prod(shape) * dtype.itemsize
        for (_, _, shape), dtype in zip(specs, dtypes, strict=True)
    ]
    at = path.stat().st_size - sum(sizes)  # the data's first byte
    entries = []
    for (name, _, shape), dtype, nbytes in zip(specs, dtypes, sizes, strict=True):
        entries.append(TensorEntry(name, dtype, shape, at, at + nbytes))
        at += nbytes
    return entries


class CheckpointError(ValueError):
    pass


def weight_roots(model_dir: Path) -> tuple[Path, ...]:
    """Where a checkpoint's files may resolve to: its folder, and for a Hugging Face hub
    snapshot (`models--org--name/snapshots/REV`, whose files link to `../../blobs/SHA`) its
    repository's blobs folder."""
    folder = model_dir.resolve()
    if folder.parent.name == "snapshots":
        return folder, folder.parent.parent / "blobs"
    return (folder,)


def _inside(path: Path, model_dir: Path) -> Path:
    """`path`, once it resolves (symbolic links followed) inside the checkpoint (weight_roots);
    else a CheckpointError naming the file and the rule, before any byte of it is read."""
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in weight_roots(model_dir)):
        raise CheckpointError(
            f"{path.name} in {model_dir} resolves outside the checkpoint folder (symbolic "
            "links followed): a checkpoint's files must be inside it"
        )
    return path


def _shard_name(index: Path, name: str) -> str:
    """An index's shard file name, refused unless a plain file name: no folder, no `..`."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointError(
            f"{index} names a shard {name!r} that is not a plain file name: shards are files "
            "of the checkpoint's own folder"
        )
    return name


def checkpoint_files(model_dir: Path, confined: bool = False) -> list[Path]:
    """The checkpoint's safetensors files: those its index names (each a plain file name),
    else model.safetensors, else every *.safetensors. `confined` (new weights, from a folder
    a client named): the index and each file must resolve inside the checkpoint (`_inside`);
    the folder served from start is its operator's, whose links may point anywhere."""

    def inside(path: Path) -> Path:
        return _inside(path, model_dir) if confined else path

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        inside(index)
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all(isinstance(name, str) for name in names):
                raise TypeError("a weight_map value is not a file name")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index} is not a safetensors index with a weight_map of tensor -> "
                f"file name ({type(e).__name__}: {e})"
            ) from None
        files = [inside(model_dir / _shard_name(index, name)) for name in names]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names shard files that are missing: {', '.join(missing)}"
            )
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [inside(single)]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {model_dir}")
    return [inside(path) for path in files]


def text_name(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor name (the MTP head's as `mtp.*`); None for
    tensors we skip."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith(VLM_TEXT_PREFIX):
        return "model." + name[len(VLM_TEXT_PREFIX) :]
    if name.startswith(MTP_PREFIXES):
        return "mtp." + name.split("mtp.", 1)[1]
    return name


def is_mtp(name: str) -> bool:
    """Whether a text name is the MTP head's."""
    return name.startswith(MTP_PREFIXES[0])


def check_new_weights(serving_dir: str, new_dir: str, config: ModelConfig) -> None:
    """A ValueError unless `new_dir` is a checkpoint of the served model: a config.json that
    reads as the same model's (`config`), and the same tensors (`check_same_tensors`)."""
    try:
        new_config = ModelConfig.from_model_dir(new_dir)
    except (OSError, ValueError):  # its message could quote a file that is no config
        raise ValueError(
            f"{new_dir} is not a checkpoint of the served model: it has no config.json "
            "that reads as a model's config"
        ) from None
    differences = config.differences(new_config)
    if differences:
        raise ValueError(
            f"{new_dir} is not the served model: its config.json differs in "
            f"{', '.join(differences)}"
        )
    check_same_tensors(serving_dir, new_dir, config)


def check_same_tensors(serving_dir: str | Path, new_dir: str | Path, config: ModelConfig) -> None:
    """Raise CheckpointError unless `new_dir` (confined: checkpoint_files) holds the serving
    checkpoint's text tensors, each
    of the same shape and floating point (FP8 where the served one is), read from the files'
    headers alone: a weight update checks this before any rank copies a tensor (a rank failing
    half-way poisons the replica)."""
    tie_word_embeddings = config.tie_word_embeddings

    def tensors(model_dir: Path, confined: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        try:
            for path in checkpoint_files(model_dir, confined):
                for entry in read_header(path):
                    name = text_name(entry.name)
                    if (
                        name is not None
                        and not is_mtp(name)  # optional in new weights (load_weights)
                        and not (name == "lm_head.weight" and tie_word_embeddings)
                    ):
                        out[name] = (entry.shape, entry.dtype)
        except (SafetensorsError, OSError) as e:
            raise CheckpointError(f"{model_dir}: {e}") from None
        return out

    old, new = tensors(Path(serving_dir), False), tensors(Path(new_dir), True)
    problems = [f"{name} missing" for name in sorted(old.keys() - new.keys())]
    problems += [f"{name} unexpected" for name in sorted(new.keys() - old.keys())]
    problems += [
        f"{name} of shape {list(new[name][0])}, not {list(old[name][0])}"
        for name in sorted(old.keys() & new.keys())
        if new[name][0] != old[name][0]
    ]

    def foreign(name: str, dtype: torch.dtype) -> bool:  # plain floats convert; any other matches
        served = old.get(name, ((), None))[1]
        return dtype != served and (
            dtype not in FLOAT_DTYPES or (served is not None and served not in FLOAT_DTYPES)
        )

    problems += [
        f"{name} of dtype {str(dtype).removeprefix('torch.')}"
        for name, (_, dtype) in sorted(new.items())
        if foreign(name, dtype)
    ]
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        )
        raise CheckpointError(f"{new_dir} does not hold the served model's tensors: {shown}")
