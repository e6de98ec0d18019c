"""The scheduler's ledger of rank capacity: state slots and KV blocks.

Mirrors what every rank takes when a request's first chunk arrives (one slot, and
ceil(reserve_tokens / block_size) KV blocks for prompt + max_tokens positions), so that a
plan the scheduler sends can never run a rank out of either. Ask before acting, as nano-vllm's
`can_allocate`/`allocate`: `can_admit` has no side effects, `admit` reserves.
"""

from __future__ import annotations


class CapacityError(ValueError):
    """An admit or release the ledger cannot honour: a scheduler bug, never user input."""


class CapacityLedger:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_slots", num_slots), ("num_blocks", num_blocks), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._held: dict[int, int] = {}  # request id -> blocks reserved
        self._blocks_used = 0

    @property
    def free_slots(self) -> int:
        return self.num_slots - len(self._held)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._blocks_used

    @property
    def num_admitted(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._held

    def blocks_for(self, reserve_tokens: int) -> int:
        return -(-reserve_tokens // self.block_size)

    def fits_ever(self, reserve_tokens: int) -> bool:
        """Whether an otherwise empty replica could hold this reservation."""
        return self.blocks_for(reserve_tokens) <= self.num_blocks

    def can_admit(self, reserve_tokens: int) -> bool:
        return self.free_slots >= 1 and self.blocks_for(reserve_tokens) <= self.free_blocks

    def admit(self, request_id: int, reserve_tokens: int) -> None:
        if request_id in self._held:
            raise CapacityError(f"request {request_id} is already admitted")
        blocks = self.blocks_for(reserve_tokens)
        if self.free_slots < 1 or blocks > self.free_blocks:
            raise CapacityError(
                f"request {request_id} needs 1 slot and {blocks} blocks; "
                f"{self.free_slots} slots and {self.free_blocks} blocks are free"
            )
        self._held[request_id] = blocks
        self._blocks_used += blocks

    def release(self, request_id: int) -> None:
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            raise CapacityError(f"request {request_id} holds no reservation")
        self._blocks_used -= blocks
