"""Which images' encodings the ranks keep, so that a conversation does not encode its earlier
images again: a least-recently-used index of media keys (their pixels' SHA-256), bounded in
embedding tokens.

Torch-free. The scheduler and every rank each run one over the same sequence of uses (the
media of each step's items, in order: ranks receive the same commands), so they agree on what
is held by construction: the scheduler sends a medium's pixels only when its index lacks the
key, and a rank that finds no encoding for a key sent without pixels refuses the step.
"""

from __future__ import annotations

from collections import OrderedDict

ENCODER_CACHE_TOKENS = 16384  # embedding rows kept per rank: 84 MB at the 4B model's width (bf16)


class EncoderCacheIndex:
    def __init__(self, capacity_tokens: int = ENCODER_CACHE_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self.tokens = 0
        self._held: OrderedDict[bytes, int] = OrderedDict()  # key -> its embedding rows

    def __contains__(self, key: bytes) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def use(self, key: bytes, num_tokens: int) -> list[bytes]:
        """Mark `key` (of `num_tokens` rows) most recently used, adding it if new; returns the
        keys evicted to stay within capacity (never `key`: one larger than the capacity is
        kept alone until the next use)."""
        if key in self._held:
            self._held.move_to_end(key)
            return []
        self._held[key] = num_tokens
        self.tokens += num_tokens
        evicted = []
        while self.tokens > self.capacity_tokens and len(self._held) > 1:
            old, rows = self._held.popitem(last=False)
            self.tokens -= rows
            evicted.append(old)
        return evicted

    def clear(self) -> None:
        self._held.clear()
        self.tokens = 0
