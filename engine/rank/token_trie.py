"""The vocabulary as a trie of its tokens' bytes, laid out for walking level by level.

A guided mask walks every token through the pattern's automaton. Walked token by token the
walk costs every byte of the vocabulary (1.8M for Qwen's 248k tokens) wherever most tokens
stay alive, and all 248k tokens at their first byte where nearly all die there. Walked over
the trie, tokens that share a prefix walk it once (592k nodes for Qwen's vocabulary), and a
byte that kills a node kills every token under it: outside a string the walk ends after the
256 nodes of the first level. (llguidance and outlines-core walk a token trie the same way,
node by node; here a level's live nodes move at once, as arrays.)

Nodes are numbered level by level, each level in the order of the bytes it spells, so a
node's children are the contiguous range `child_lo[n]:child_hi[n]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenTrie:
    """`byte[n]`: the byte node n adds; `token[n]`: the token id its bytes spell, or -1;
    `parent[n]`: its parent's index in the level above; `child_lo[n]:child_hi[n]`: its
    children; the first level's nodes are `0:roots`. Numpy arrays: a walk is many small
    operations, and numpy's cost per operation is a fraction of torch's."""

    ARRAYS = ("byte", "token", "parent", "child_lo", "child_hi")

    def __init__(
        self, token_bytes: Sequence[bytes | None], arrays: dict[str, np.ndarray] | None = None
    ) -> None:
        """Built from the tokens' bytes, or taken from `arrays` (`to_arrays`' of a trie built
        from these same bytes: engine/rank/vocab_cache.py keeps them on disk)."""
        self.token_bytes = list(token_bytes)
        if arrays is not None:
            for name in self.ARRAYS:
                setattr(self, name, arrays[name].astype(np.int64))
            self.level_start = arrays["level_start"].tolist()
            self._index_levels()
            return
        in_order = sorted(
            (i for i, b in enumerate(self.token_bytes) if b), key=self.token_bytes.__getitem__
        )
        spelled = [self.token_bytes[i] for i in in_order]
        ids = np.array(in_order, dtype=np.int64)
        lengths = np.fromiter(map(len, spelled), dtype=np.int64, count=len(spelled))
        data = np.frombuffer(b"".join(spelled), dtype=np.uint8).astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        shared = _shared_prefix_lengths(data, starts, lengths)
        # token k (in byte order) adds the nodes of its prefixes longer than the one it
        # shares with token k - 1: those shorter were added by earlier tokens
        added = lengths - shared
        owner = np.repeat(np.arange(ids.shape[0]), added)
        first = np.cumsum(added) - added
        depth = shared[owner] + 1 + np.arange(owner.shape[0]) - first[owner]
        level_order = np.argsort(depth, kind="stable")  # by depth, then byte order
        owner, depth = owner[level_order], depth[level_order]
        self.byte = data[starts[owner] + depth - 1]
        self.token = np.where(depth == lengths[owner], ids[owner], -1)
        # a node's parent is the node one level up on its owner's path: the last node of
        # that level owned by a token at or before its owner (tokens are in byte order)
        levels = np.bincount(depth) if depth.size else np.zeros(1, dtype=np.int64)
        self.level_start = [0, *np.cumsum(levels).tolist()]
        nodes = owner.shape[0]
        self.parent = np.full(nodes, -1, dtype=np.int64)  # its index in its level
        self.child_lo = np.full(nodes, nodes, dtype=np.int64)
        self.child_hi = np.full(nodes, nodes, dtype=np.int64)
        for d in range(2, levels.shape[0]):
            above, here = self.level(d - 1), self.level(d)
            parent = np.searchsorted(owner[above], owner[here], side="right") - 1
            self.parent[here] = parent
            children = np.bincount(parent, minlength=above.stop - above.start)
            ends = np.cumsum(children) + here.start
            self.child_hi[above] = ends
            self.child_lo[above] = ends - children
        self._index_levels()

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            **{name: getattr(self, name) for name in self.ARRAYS},
            "level_start": np.array(self.level_start),
        }

    def _index_levels(self) -> None:
        """Each level's nodes that end a token (their index in the level) and the token ids."""
        self.level_tokens = []
        for d in range(len(self.level_start) - 1):
            ending = np.flatnonzero(self.token[self.level(d)] >= 0)
            self.level_tokens.append((ending, self.token[ending + self.level_start[d]]))
        self.roots = self.level(1).stop if self.depth >= 1 else 0

    @property
    def depth(self) -> int:
        """The longest token's length: the trie's last level."""
        return len(self.level_start) - 2

    def level(self, d: int) -> slice:
        """The nodes of level `d` (tokens' d-th bytes; level 0 is empty)."""
        return slice(self.level_start[d], self.level_start[d + 1])

    @property
    def num_nodes(self) -> int:
        return self.byte.shape[0]


def _shared_prefix_lengths(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """For tokens in byte order: how many leading bytes each shares with the one before (0
    for the first). Compared a position at a time, over the pairs still equal."""
    shared = np.zeros_like(lengths)
    pair = np.arange(1, lengths.shape[0])
    k = 0
    while pair.size:
        pair = pair[(lengths[pair] > k) & (lengths[pair - 1] > k)]
        pair = pair[data[starts[pair] + k] == data[starts[pair - 1] + k]]
        shared[pair] += 1
        k += 1
    return shared


__all__ = ["TokenTrie"]
