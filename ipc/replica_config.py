"""What a replica is made of, checked before any rank starts, and the errors it raises."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from deltaserve.ipc.faults import FaultPlan
from deltaserve.ipc.launch import RankConfig

DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16")


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    model_dir: str
    tp_size: int = 1
    device: str = "cpu"  # "cpu" | "cuda"
    device_ids: tuple[int, ...] | None = None  # cuda ordinals, default range(tp_size)
    dtype: str = "auto"
    block_size: int = 16
    num_slots: int = 8
    num_blocks: int = 256  # 0: each rank sizes it from gpu_memory_utilization (cuda only)
    max_model_len: int = 0  # longest request in positions (sizes CUDA graphs); 0: whole cache
    gpu_memory_utilization: float = 0.9  # when num_blocks is 0: share of each device's memory
    max_num_batched_tokens: int = 2048  # when num_blocks is 0: tokens of the profiling step
    cuda_graphs: bool = True  # cuda: single-token items replay CUDA graphs
    prompt_graph_tokens: int = 2048  # cuda, with cuda_graphs: prompt steps up to this size too
    fp8_weights: str = "widen"  # an FP8 checkpoint's projections widened as they load, or kept FP8
    max_logprobs: int = 20  # a step item's logprobs and prompt logprobs at most (ipc/validate.py)
    prefix_states: int = 0  # saved prefix states each rank keeps (prefix caching); 0: off
    max_drafts: int = 0  # speculative decoding's drafts per step item at most; 0: off (no MTP)
    overlap_steps: bool | None = (
        None  # ranks queue a follower before finishing the step; None: on cuda
    )
    startup_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    gate_timeout_s: float = 10.0  # every rank must record receipt of a gated command by then
    fault: FaultPlan | None = None  # tests only (ipc/faults.py)
    journal_dir: str | None = None  # tests: ranks log gated commands to DIR/rank{r}.log
    noop_executor: bool = False  # benchmarks only: ranks do no model work
    noop_step_s: float = 0.0  # ... and sleep this long per step (a stand-in for the GPU)

    def rank_config(self, rank: int, device: str, run_dir: str, **channels: object) -> RankConfig:
        """What rank `rank` is started with: this replica's settings, its device, and the
        `channels` the controller made for it (endpoints, gate name, doorbell fds)."""
        journal = None if self.journal_dir is None else f"{self.journal_dir}/rank{rank}.log"
        return RankConfig(
            rank=rank,
            world_size=self.tp_size,
            parent_pid=os.getpid(),
            release_timeout_s=self.gate_timeout_s + 5.0,
            model_dir=str(self.model_dir),
            device=device,
            dtype=self.dtype,
            block_size=self.block_size,
            num_slots=self.num_slots,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            cuda_graphs=self.cuda_graphs,
            prompt_graph_tokens=self.prompt_graph_tokens,
            fp8_weights=self.fp8_weights,
            prefix_states=self.prefix_states,
            mtp=self.max_drafts > 0,
            overlap_steps=(
                self.device == "cuda" if self.overlap_steps is None else self.overlap_steps
            )
            and not self.noop_executor,
            dist_init_method=f"file://{run_dir}/dist-store",
            dist_timeout_s=max(self.startup_timeout_s, 2 * self.step_timeout_s),
            noop_executor=self.noop_executor,
            noop_step_s=self.noop_step_s,
            journal_path=journal,
            fault=self.fault,
            log_level=logging.getLogger(
                "deltaserve"
            ).getEffectiveLevel(),  # --log-level reaches ranks
            **channels,
        )

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(
                f"device must be 'cpu' or 'cuda', got {self.device!r} (pick GPUs with device_ids)"
            )
        if self.device_ids is not None:
            if self.device == "cpu":
                raise ValueError(
                    f"device_ids {self.device_ids} given with device 'cpu'; they name CUDA devices"
                )
            if len(self.device_ids) != self.tp_size:
                raise ValueError(
                    f"device_ids {self.device_ids} has {len(self.device_ids)} entries for tp_size {self.tp_size}"
                )
            if len(set(self.device_ids)) != len(self.device_ids):
                raise ValueError(f"device_ids {self.device_ids} names a device twice")
            if min(self.device_ids) < 0:
                raise ValueError(f"device_ids {self.device_ids} has a negative ordinal")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "num_slots", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 0 or (self.num_blocks == 0 and self.device != "cuda"):
            raise ValueError(
                f"num_blocks must be >= 1 (or 0 on cuda: size from memory), got {self.num_blocks}"
            )
        if self.num_blocks == 0 and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
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
