"""Checkpoint bytes to the device: our parallel reader against the safetensors library's own.

Both read the same safetensors file(s), every tensor, from the page cache (one unmeasured
pass first), and copy each tensor into a destination made beforehand, as the loader copies
into the model's parameters:
- `ours`: engine/rank/checkpoint_reader.py's parallel path (the loader's on CUDA): the
  header read and checked by the library (`read_header`), the data by --readers threads with
  preadv into reused host buffers (pinned on CUDA), copied to the device as they fill;
- `safetensors`: `safe_open(path, "pt", device=...)` and `get_tensor` per tensor (its mmap;
  the loader's path on the CPU).
The passes alternate, --reps each; the JSON gives each pass's GB/s and each way's best and
median, with the command, the hardware and the commit. Without --model a synthetic file of
--size-mib (tensors of 4 MiB and a few small ones, bf16) is made under --workdir.

    python -m tools.bench_checkpoint_read --device cpu --out bench/results/checkpoint_read_cpu.json
    python -m tools.bench_checkpoint_read --model /models/Qwen3.5-4B --device cuda \\
        --out bench/results/checkpoint_read_h100_4b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.engine.checkpoint_files import checkpoint_files, read_header
from deltaserve.engine.rank.checkpoint_reader import READERS, CheckpointReader
from deltaserve.tools.hardware import git_commit, host_info


def synthetic_checkpoint(folder: Path, size_mib: int) -> Path:
    """One file of `size_mib` MiB: bf16 tensors of 4 MiB, and a small one after every 16."""
    tensors = {}
    for i in range(max(1, size_mib // 4)):
        tensors[f"layer.{i}.weight"] = torch.randn(1024, 2048).to(torch.bfloat16)
        if i % 16 == 0:
            tensors[f"layer.{i}.norm"] = torch.ones(2048, dtype=torch.bfloat16)
    path = folder / "model.safetensors"
    save_file(tensors, path)
    return path


def destinations(files: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    return {
        entry.name: torch.empty(entry.shape, dtype=entry.dtype, device=device)
        for path in files
        for entry in read_header(path)
    }


def ours(files: list[Path], dest: dict[str, torch.Tensor], readers: int) -> None:
    reader = CheckpointReader(next(iter(dest.values())).device, readers=readers, parallel=True)
    for path in files:
        for name, tensor in reader.tensors(path, lambda name: True):
            dest[name].copy_(tensor)


def library(files: list[Path], dest: dict[str, torch.Tensor], readers: int) -> None:
    device = str(next(iter(dest.values())).device)
    for path in files:
        with safe_open(path, framework="pt", device=device) as f:
            for name in f.offset_keys():
                dest[name].copy_(f.get_tensor(name))


def timed(
    way: Callable[[list[Path], dict[str, torch.Tensor], int], None],
    files: list[Path],
    dest: dict[str, torch.Tensor],
    readers: int,
) -> float:
    device = next(iter(dest.values())).device
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    way(files, dest, readers)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint folder; default: synthetic")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--workdir", default=None, help="where the synthetic file goes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--readers", type=int, default=READERS)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.workdir) as scratch:
        if args.model is None:
            files = [synthetic_checkpoint(Path(scratch), args.size_mib)]
        else:
            files = checkpoint_files(Path(args.model))
        device = torch.device(args.device)
        dest = destinations(files, device)
        nbytes = sum(t.numel() * t.element_size() for t in dest.values())
        ways = {"ours": ours, "safetensors": library}
        for way in ways.values():  # the page cache warm, the buffers and the CUDA context made
            timed(way, files, dest, args.readers)
        gbps: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, way in ways.items():
                gbps[name].append(nbytes / timed(way, files, dest, args.readers) / 1e9)
    report = {
        "command": " ".join(
            ["python -m tools.bench_checkpoint_read", *(sys.argv[1:] if argv is None else argv)]
        ),
        "hardware": {**host_info(), "torch": torch.__version__},
        "commit": git_commit(),
        "device": str(device),
        "readers": args.readers,
        "checkpoint": args.model or f"synthetic {args.size_mib} MiB bf16",
        "bytes": nbytes,
        "tensors": len(dest),
        "gb_per_s": {name: [round(v, 3) for v in values] for name, values in gbps.items()},
        "best_gb_per_s": {name: round(max(v), 3) for name, v in gbps.items()},
        "median_gb_per_s": {name: round(statistics.median(v), 3) for name, v in gbps.items()},
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
