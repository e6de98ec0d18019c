"""An executor that does no model work, for tools/bench_ipc.py only: it lets the benchmark
measure the control plane alone. Tests use the real Executor."""

from __future__ import annotations

from deltaserve.engine.rank.executor import RankSnapshot
from deltaserve.ipc.messages import Sample, StepItem


class NoopExecutor:
    def __init__(self, rank: int, num_slots: int, num_blocks: int, block_size: int) -> None:
        self.rank = rank
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size

    def run_step(self, items: list[StepItem]) -> list[Sample]:
        if self.rank != 0:
            return []
        return [Sample(item.request_id, 0, 0.0, []) for item in items if item.sample]

    def drop(self, request_ids: list[int]) -> list[bool]:
        return [False] * len(request_ids)

    def snapshot(self) -> RankSnapshot:
        return RankSnapshot([], 0, 0, self.num_slots, self.num_blocks, 0, 0)
