"""Which tokens a guided request may sample next: the whole vocabulary walked through the
guide's byte automaton at once.

A token is allowed in DFA state s when its bytes lead from s to a live state (one from which
the pattern can still be completed). Walking 248k tokens one by one in Python would take
seconds, so the walk is array work over the vocabulary's trie (engine/rank/token_trie.py), a
level at a time: one gather moves every node of a level through the DFA's transition table
(rows the lazy DFA had not made yet are made when a walk reaches them), and a node that dies
takes every token under it along. The arrays are numpy's: a walk is many small operations,
and numpy's cost per operation is a fraction of torch's. The mask of a state is cached per guide (packed eight
tokens to a byte, on the device), and a guide per pattern, so the requests of one schema
share the work: the string states of a JSON document, where most of the vocabulary is
allowed, are walked once. (xgrammar precomputes such context-independent token sets per
grammar position; this is the same saving, found lazily.)
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from deltaserve.engine.rank.token_trie import TokenTrie
from deltaserve.engine.regex_automaton import DEAD, START, ByteAutomaton

MASKS_PER_GUIDE = 2048  # each vocab / 8 bytes on the device: 64 MB for Qwen's 248k tokens


class Guide:
    """One pattern on rank 0: its automaton, the transition table the walks have filled in,
    and the token masks of the states reached (least recently used dropped past
    MASKS_PER_GUIDE)."""

    def __init__(self, pattern: str, trie: TokenTrie) -> None:
        self.automaton = ByteAutomaton(pattern)
        self._trie = trie
        # flat transition table: [state * 256 + byte] = next state * 256 (the offset of its
        # row, so a walk adds the byte and gathers); a row not made yet holds -(state + 1)
        self._table = np.zeros(0, dtype=np.int64)
        self._rows = 0  # states the table has a row (made or marked) for
        self._mark_new_states()
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (DEAD for a token the pattern cannot take, or one that
        writes no bytes)."""
        vocabulary = self._trie.token_bytes
        data = vocabulary[token] if 0 <= token < len(vocabulary) else None
        return self.automaton.step(state, data) if data else DEAD

    def mask(
        self, state: int, end_ids: tuple[int, ...], width: int, device: torch.device
    ) -> torch.Tensor:
        """Bool [width] on `device`: the tokens allowed in `state`, and `end_ids` where the
        output may end there. Where nothing else may follow (the output complete, or DEAD
        after a token the mask did not offer), the end ids alone."""
        key = (state, end_ids, width, device)
        packed = self._masks.get(key)
        if packed is None:
            allowed = self.allowed_tokens(state)
            mask = np.zeros(width, dtype=bool)
            n = min(width, allowed.shape[0])
            mask[:n] = allowed[:n]
            if self.automaton.accepting[state] or not mask.any():
                mask[[t for t in end_ids if t < width]] = True
            packed = torch.from_numpy(np.packbits(mask, bitorder="little")).to(device)
            self._masks[key] = packed
            while len(self._masks) > MASKS_PER_GUIDE:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return unpack(packed, width)

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Bool [len(vocabulary)] (numpy): the tokens whose bytes lead from `state` to a live
        state.

        The trie is walked a level at a time. While few nodes live (outside strings nearly
        all die at their first byte) the walk carries only those, each expanded to its
        children. Once their children fill a third of the next level (inside a string most
        nodes live), it carries whole levels, each node in the state its parent left, dead
        ones in DEAD (whose row leads only to DEAD): a third of the array operations per node."""
        trie = self._trie
        allowed = np.zeros(len(trie.token_bytes), dtype=bool)
        if state == DEAD or trie.roots == 0:
            return allowed
        self._mark_new_states()  # `advance` may have made states the table lacks
        # the live nodes of level d, and the row offset of the state their parents left
        node, here, d = np.arange(trie.roots), np.full(trie.roots, state * 256), 1
        while True:
            went = self._step(here + trie.byte[node])
            token = trie.token[node]
            allowed[token[(went != DEAD) & (token >= 0)]] = True
            lo, hi = trie.child_lo[node], trie.child_hi[node]
            on = np.flatnonzero((went != DEAD) & (hi > lo))
            lo, count = lo[on], (hi - lo)[on]
            children = int(count.sum())
            if children == 0:
                return allowed
            below = trie.level(d + 1)
            if 3 * children >= below.stop - below.start:
                break
            parent = np.repeat(np.arange(on.shape[0]), count)
            node = np.arange(children) + (lo - (np.cumsum(count) - count))[parent]
            here, d = went[on][parent], d + 1
        level = trie.level(d)
        went_whole = np.zeros(level.stop - level.start, dtype=np.int64)  # DEAD
        went_whole[node[on] - level.start] = went[on]
        for deeper in range(d + 1, trie.depth + 1):
            level = trie.level(deeper)
            went_whole = self._step(went_whole[trie.parent[level]] + trie.byte[level])
            ending, token = trie.level_tokens[deeper]
            allowed[token] = went_whole[ending] != DEAD
            if not went_whole.any():
                break
        return allowed

    def _step(self, index: np.ndarray) -> np.ndarray:
        """The table at `index` (state row offset + byte), making the rows it reaches that
        were not made yet."""
        went = self._table[index]
        if went.min() < 0:
            for unmade in np.unique(-went[went < 0] - 1).tolist():
                self._make_row(unmade)
            went = self._table[index]
        return went

    def _make_row(self, state: int) -> None:
        row = self.automaton.row(state)  # may make new states
        self._mark_new_states()
        self._table[state * 256 : (state + 1) * 256] = np.array(row, dtype=np.int64) * 256

    def _mark_new_states(self) -> None:
        """Rows for the states the automaton made since the last call, marked not made yet
        (DEAD's row is all DEAD from the start)."""
        states = self.automaton.num_states
        if states <= self._rows:
            return
        if states * 256 > self._table.shape[0]:
            grown = np.empty(max(states, 2 * self._rows, 64) * 256, dtype=np.int64)
            grown[: self._table.shape[0]] = self._table
            self._table = grown
        marks = -np.arange(self._rows, states, dtype=np.int64) - 1
        self._table[self._rows * 256 : states * 256] = np.repeat(marks, 256)
        if self._rows == 0:
            self._table[:256] = DEAD
        self._rows = states


def unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [width] from a mask packed eight tokens to a byte, lowest bit first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)  # made there: no host copy
    return ((packed[:, None] >> shifts) & 1).bool().view(-1)[:width]


__all__ = ["DEAD", "START", "Guide", "unpack"]
