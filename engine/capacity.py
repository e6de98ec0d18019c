"""The scheduler's ledger of rank capacity: state slots and KV blocks.

Mirrors what every rank takes, so that a plan the scheduler sends can never run a rank out of
either: one slot and the KV blocks of a request's first positions when its first chunk arrives
(`admit`), and more blocks as its positions grow past them (`grow`: a step item's `grow`).
Ask before acting, as nano-vllm's `can_allocate`/`allocate`: `can_admit` and `can_grow` have
no side effects, `admit` and `grow` take.

A block may have several holders: a saved prefix (engine/prefix_cache.py) holds the blocks of
the request it was saved from, and a request that starts from it shares its full ones. So the
ledger counts holders per block, as the ranks do (engine/rank/cache.py); its block numbers are
its own, not the ranks', but the two count the same holders for each block, so a block is
free here exactly when it is free on every rank.
"""

from __future__ import annotations

import itertools


class CapacityError(ValueError):
    """An admit, growth or release the ledger cannot honour: a scheduler bug, never user input."""


class CapacityLedger:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int) -> None:
        for name, value in (
            ("num_slots", num_slots),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._held: dict[int, list[int]] = {}  # request id -> its blocks
        self._holders: dict[int, int] = {}  # block in use -> how many hold it
        self._numbers = itertools.count()

    @property
    def free_slots(self) -> int:
        return self.num_slots - len(self._held)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - len(self._holders)

    @property
    def num_admitted(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._held

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether an otherwise empty replica could hold this many positions of one request."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def can_admit(self, num_tokens: int, num_shared: int = 0, keep_free: int = 0) -> bool:
        """Whether a slot and the blocks of `num_tokens` positions (`num_shared` of them a
        saved prefix's, held already) are free, leaving `keep_free` blocks free after."""
        fresh = self.blocks_for(num_tokens) - num_shared
        return self.free_slots >= 1 and fresh + keep_free <= self.free_blocks

    def admit(self, request_id: int, num_tokens: int, shared: list[int] = ()) -> None:
        """Take a slot and the blocks of `num_tokens` positions: `shared` (a saved prefix's full
        blocks) first."""
        if request_id in self._held:
            raise CapacityError(f"request {request_id} is already admitted")
        fresh = self.blocks_for(num_tokens) - len(shared)
        if self.free_slots < 1 or fresh > self.free_blocks:
            raise CapacityError(
                f"request {request_id} needs 1 slot and {fresh} blocks; "
                f"{self.free_slots} slots and {self.free_blocks} blocks are free"
            )
        blocks = [*shared, *itertools.islice(self._numbers, fresh)]
        self.hold(blocks)
        self._held[request_id] = blocks

    def growth(self, request_id: int, num_tokens: int) -> int:
        """Blocks the request must add to hold `num_tokens` positions (0 if it holds them)."""
        return max(0, self.blocks_for(num_tokens) - len(self._held[request_id]))

    def grow(self, request_id: int, num_blocks: int) -> None:
        """Add `num_blocks` free blocks to an admitted request's."""
        if num_blocks > self.free_blocks:
            raise CapacityError(
                f"request {request_id} grows by {num_blocks} blocks; {self.free_blocks} are free"
            )
        blocks = list(itertools.islice(self._numbers, num_blocks))
        self.hold(blocks)
        self._held[request_id].extend(blocks)

    def blocks(self, request_id: int) -> list[int]:
        return self._held[request_id]

    def release(self, request_id: int) -> list[int]:
        """Give back the request's slot and its holds on its blocks; returns those blocks."""
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            raise CapacityError(f"request {request_id} holds no reservation")
        self.let_go(blocks)
        return blocks

    def hold(self, blocks: list[int]) -> None:
        for b in blocks:
            self._holders[b] = self._holders.get(b, 0) + 1

    def let_go(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._holders[b] == 1:
                del self._holders[b]
            else:
                self._holders[b] -= 1

    def freed_by(self, blocks: list[int], kept: list[int] = ()) -> int:
        """How many blocks letting go of `blocks` (once per mention) would free: those with
        no other holder, but for `kept` (to be held again)."""
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        keep = set(kept)
        return sum(self._holders.get(b, 0) == n and b not in keep for b, n in counts.items())
