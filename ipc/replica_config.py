"""What a replica is made of, checked before any rank starts, and the errors it raises."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from deltaserve.ipc.faults import FaultPlan
from deltaserve.ipc.launch import RankConfig
from deltaserve.ipc.messages import ExecutorConfig
from deltaserve.ipc.validate import MAX_LOGPROBS

# the controller's bounds by default (EngineConfig's defaults are these)
STARTUP_TIMEOUT_S = 120.0  # every rank loaded and Ready by then
STEP_TIMEOUT_S = 60.0  # a command's replies all in by then
GATE_TIMEOUT_S = 10.0  # every rank must record receipt of a gated command by then


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """One replica's view of the engine's configuration (engine/config.py `replica_config`
    derives it): what every rank's executor runs, which devices the ranks take, and the
    controller's bounds. The rest is for tests and benchmarks."""

    executor: ExecutorConfig  # every rank's, its device the kind; `rank_config` places each
    device_ids: tuple[int, ...] | None = None  # cuda ordinals, default range(tp_size)
    max_logprobs: int = MAX_LOGPROBS  # a step item's logprobs and prompt logprobs at most
    overlap_steps: bool | None = None  # ranks queue a follower before finishing the step ahead
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    step_timeout_s: float = STEP_TIMEOUT_S
    gate_timeout_s: float = GATE_TIMEOUT_S
    fault: FaultPlan | None = None  # tests only (ipc/faults.py)
    journal_dir: str | None = None  # tests: ranks log gated commands to DIR/rank{r}.log
    noop_executor: bool = False  # benchmarks only: ranks do no model work
    noop_step_s: float = 0.0  # ... and sleep this long per step (a stand-in for the GPU)

    @property
    def tp_size(self) -> int:
        return self.executor.tp_size

    @property
    def device(self) -> str:
        """The ranks' device kind: "cpu" or "cuda"."""
        return self.executor.device

    def rank_config(self, rank: int, device: str, run_dir: str, **channels: object) -> RankConfig:
        """What rank `rank` is started with: this replica's executor settings placed on
        `device`, and the `channels` the controller made for it (endpoints, gate name,
        doorbell fds)."""
        journal = None if self.journal_dir is None else f"{self.journal_dir}/rank{rank}.log"
        overlap = self.device == "cuda" if self.overlap_steps is None else self.overlap_steps
        return RankConfig(
            executor=msgspec.structs.replace(self.executor, rank=rank, device=device),
            parent_pid=os.getpid(),
            release_timeout_s=self.gate_timeout_s + 5.0,
            dist_init_method=f"file://{run_dir}/dist-store",
            dist_timeout_s=max(self.startup_timeout_s, 2 * self.step_timeout_s),
            overlap_steps=overlap and not self.noop_executor,
            noop_executor=self.noop_executor,
            noop_step_s=self.noop_step_s,
            journal_path=journal,
            fault=self.fault,
            # --log-level reaches the ranks
            log_level=logging.getLogger("deltaserve").getEffectiveLevel(),
            **channels,
        )

    def __post_init__(self) -> None:
        if self.executor.device not in ("cpu", "cuda") or self.executor.rank != 0:
            raise ValueError(
                f"a replica's executor settings name the device kind, 'cpu' or 'cuda' (pick "
                f"GPUs with device_ids), and rank 0; got {self.executor.device!r}, rank "
                f"{self.executor.rank}"
            )
        if self.executor.num_kv_blocks is None and self.device == "cpu":
            raise ValueError(
                "num_kv_blocks None sizes the KV cache from device memory: CUDA only; give "
                "num_kv_blocks"
            )
        if self.device_ids is not None:
            if self.device == "cpu":
                raise ValueError(
                    f"device_ids {self.device_ids} given with device 'cpu'; they name CUDA devices"
                )
            if len(self.device_ids) != self.tp_size:
                raise ValueError(
                    f"device_ids {self.device_ids} has {len(self.device_ids)} entries for "
                    f"tp_size {self.tp_size}"
                )
            if len(set(self.device_ids)) != len(self.device_ids):
                raise ValueError(f"device_ids {self.device_ids} names a device twice")
            if min(self.device_ids) < 0:
                raise ValueError(f"device_ids {self.device_ids} has a negative ordinal")
        for name in ("startup_timeout_s", "step_timeout_s", "gate_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.fault is not None and self.fault.rank >= self.tp_size:
            raise ValueError(f"fault.rank {self.fault.rank} is outside tp_size {self.tp_size}")

    def rank_devices(self) -> list[str]:
        """Each rank's device, after checking the ordinals against this machine."""
        if self.device == "cpu":
            return ["cpu"] * self.tp_size
        ids = self.device_ids if self.device_ids is not None else tuple(range(self.tp_size))
        count = cuda_device_count()
        for ordinal in ids:
            if ordinal >= count:
                raise ValueError(
                    f"CUDA device {ordinal} does not exist: this machine has {count} CUDA device(s)"
                )
        return [f"cuda:{ordinal}" for ordinal in ids]


class ReplicaPoisoned(RuntimeError):
    """Fatal: the replica is unusable; `reason` is the first thing that went wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"replica poisoned: {reason}")
        self.reason = reason


class ReplicaStartupError(RuntimeError):
    """The ranks did not all come up; everything started has been torn down."""


def cuda_device_count() -> int:
    """The CUDA devices this process may use, read as the CUDA runtime reads them: the
    driver's GPUs, narrowed by CUDA_VISIBLE_DEVICES up to its first invalid entry. Without
    torch: importing it here would cost the server seconds before its ranks even spawn."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if not gpus.is_dir():
        if not Path("/dev/nvidiactl").exists():
            return 0
        import torch  # a driver without the /proc listing: ask the runtime

        return torch.cuda.device_count()
    return visible_devices(sum(1 for _ in gpus.iterdir()), os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_devices(present: int, visible: str | None) -> int:
    """How many of `present` GPUs CUDA_VISIBLE_DEVICES `visible` leaves: the CUDA runtime
    reads its entries (ordinals, or GPU-/MIG- UUIDs) up to the first invalid or repeated one."""
    if visible is None:
        return present
    seen: set[str] = set()
    for entry in (e.strip() for e in visible.split(",")):
        valid = entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < present)
        if not valid or entry in seen:
            break
        seen.add(entry)
    return len(seen)
