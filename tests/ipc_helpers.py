"""What the control-plane tests share: a replica's configuration over a checkpoint, with a
cache small enough for the CPU."""

from __future__ import annotations

from pathlib import Path

from deltaserve.ipc.messages import ExecutorConfig
from deltaserve.ipc.replica_config import ReplicaConfig

SMALL_CACHE = {"max_num_seqs": 8, "num_kv_blocks": 256}  # what these tests' steps hold at most


def replica_config(model_dir: Path | str, **fields: object) -> ReplicaConfig:
    """A replica of the checkpoint at `model_dir`; `fields` are ExecutorConfig's (every rank
    runs them) or ReplicaConfig's, told apart by name."""
    executor = {k: v for k, v in fields.items() if k in ExecutorConfig.__struct_fields__}
    replica = {k: v for k, v in fields.items() if k not in executor}
    return ReplicaConfig(ExecutorConfig(str(model_dir), **{**SMALL_CACHE, **executor}), **replica)
