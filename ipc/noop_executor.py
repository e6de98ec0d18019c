"""An executor that does no model work, for benchmarks only (tools/bench_ipc.py, and the
engine's own overhead): it lets them measure the control plane and the scheduler alone. It
holds the ids of the requests it was given, so that the engine's drops find them. Tests use
the real Executor."""

from __future__ import annotations

import time

from deltaserve.engine.rank.executor import LaunchedStep, RankSnapshot
from deltaserve.ipc.messages import ExecutorConfig, Sample, StepItem


class NoopExecutor:
    def __init__(self, config: ExecutorConfig, step_s: float = 0.0) -> None:
        if config.num_kv_blocks is None:
            raise ValueError("the no-op executor sizes nothing from memory: give num_kv_blocks")
        self.rank = config.rank
        self.num_slots = config.max_num_seqs
        self.num_blocks = config.num_kv_blocks
        self.block_size = config.block_size
        self.step_s = step_s  # slept per step: a stand-in for the GPU
        self.held: set[int] = set()

    def launch_step(
        self, items: list[StepItem], drops: list[int] = (), evict: list[int] = (), saves: list = ()
    ) -> LaunchedStep:
        if not self.held.issuperset(drops):
            raise ValueError(f"requests {sorted(set(drops) - self.held)} to drop are not held")
        self.held.difference_update(drops)
        self.held.update(item.request_id for item in items if item.new is not None)
        if self.step_s:
            time.sleep(self.step_s)
        return LaunchedStep(items)

    def launch_sampling(self, step: LaunchedStep) -> None:
        pass

    def finish_step(self, step: LaunchedStep) -> list[Sample]:
        if self.rank != 0:
            return []
        return [Sample(item.request_id, 0, 0.0, []) for item in step.items if item.sample]

    def drop(self, request_ids: list[int], evict: list[int] = (), saves: list = ()) -> list[bool]:
        existed = [rid in self.held for rid in request_ids]
        self.held.difference_update(request_ids)
        return existed

    def watch_late_compiles(self) -> None:
        pass

    def snapshot(self) -> RankSnapshot:
        return RankSnapshot(sorted(self.held), 0, 0, self.num_slots, self.num_blocks, 0, 0)
